"""One output choice's way back from token IDs: detokenize, split reasoning, parse tool calls.

A `ChoiceDecoder` is fed each batch of new token IDs once and keeps only state machines
(no text history), so every feed costs O(new tokens). The collocated server keeps one in
memory per choice; the stateless render tier ships `state()` to the client between chunks
and rebuilds with `from_state()`: the same code either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.frontend.detokenizer import IncrementalDetokenizer
from splitserve.frontend.reasoning_parser import ReasoningParser
from splitserve.frontend.tokenizer import Tokenizer
from splitserve.frontend.tool_parser import HermesToolParser
from splitserve.protocol.openai_chunks import ChoiceDelta, ToolCallDelta

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class DecodeOptions:
    """What a request asks of the way back; rebuilt from the request on every call."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    reasoning: bool = True  # split <think>...</think> into `reasoning`
    tools: bool = False  # parse Hermes <tool_call> blocks into tool_calls
    logprobs: bool = False
    top_logprobs: int = 0


def token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    """A token's OpenAI logprob entry: its text, and its own bytes (for a byte-level
    tokenizer, the raw bytes, which may be part of a multi-byte character)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    raw = tokenizer.token_bytes(token_id) if tokenizer.byte_level else b""
    return {"token": text, "logprob": float(logprob), "bytes": list(raw or text.encode())}


def openai_logprobs(tokenizer: Tokenizer, entries: Sequence[dict], top_n: int) -> list[dict]:
    """Engine logprob entries ({token_id, logprob, top_logprobs: [{token_id, logprob}]})
    → OpenAI chat entries with token strings and bytes."""
    result = []
    for entry in entries:
        top = []
        for candidate in (entry.get("top_logprobs") or [])[:top_n]:
            if isinstance(candidate, (list, tuple)):  # in-process shape: [token_id, logprob]
                candidate = {"token_id": candidate[0], "logprob": candidate[1]}
            top.append(token_entry(tokenizer, int(candidate["token_id"]), candidate["logprob"]))
        result.append(
            {**token_entry(tokenizer, int(entry["token_id"]), entry["logprob"]), "top_logprobs": top}
        )
    return result


def prompt_opens_reasoning(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> bool:
    """True when the prompt's last reasoning marker is an open <think> (a template that
    starts the assistant turn inside reasoning); a closed one (enable_thinking false) or
    none means the output starts as content."""
    start, end = vocab_id(tokenizer, THINK_START), vocab_id(tokenizer, THINK_END)
    if start is None:
        return False
    for token_id in reversed(prompt_token_ids):
        if token_id == start:
            return True
        if token_id == end:
            return False
    return False


def vocab_id(tokenizer: Tokenizer, text: str) -> int | None:
    lookup = tokenizer.token_to_id
    return lookup(text) if callable(lookup) else lookup.get(text)


def model_has_reasoning(tokenizer: Tokenizer) -> bool:
    return vocab_id(tokenizer, THINK_START) is not None and vocab_id(tokenizer, THINK_END) is not None


class ChoiceDecoder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        options: DecodeOptions,
        *,
        starts_in_reasoning: bool = False,
        tool_id_salt: str = "",
        _state: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        detok_kwargs = {
            "skip_special_tokens": options.skip_special_tokens,
            "stop": options.stop,
            "include_stop_str_in_output": options.include_stop_str_in_output,
        }
        if _state is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, **detok_kwargs)
            self.reasoning = (
                ReasoningParser(starts_in_reasoning=starts_in_reasoning) if options.reasoning else None
            )
            # tool call ids derive from (salt, index): the same on every replica
            self.tools = HermesToolParser(id_salt=tool_id_salt) if options.tools else None
            self.num_tokens = 0
            self.num_tool_calls = 0
        else:
            self.detokenizer = IncrementalDetokenizer.from_state(tokenizer, _state["d"], **detok_kwargs)
            self.reasoning = ReasoningParser.from_state(_state["r"]) if options.reasoning else None
            self.tools = HermesToolParser.from_state(_state["t"]) if options.tools else None
            self.num_tokens = int(_state["n"])
            self.num_tool_calls = int(_state["c"])

    @property
    def stopped(self) -> bool:
        """A stop string matched: later tokens are ignored and the engine can be aborted."""
        return bool(self.detokenizer.stopped)

    def state(self) -> dict[str, Any]:
        return {
            "d": self.detokenizer.state(),
            "r": self.reasoning.state() if self.reasoning is not None else None,
            "t": self.tools.state() if self.tools is not None else None,
            "n": self.num_tokens,
            "c": self.num_tool_calls,
        }

    @classmethod
    def from_state(cls, tokenizer: Tokenizer, options: DecodeOptions, state: dict[str, Any]) -> ChoiceDecoder:
        return cls(tokenizer, options, _state=state)

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[dict] | None = None) -> ChoiceDelta:
        consumed = 0
        pieces: list[str] = []
        if self.options.stop:
            # one token at a time so the token that completes a stop string is the last counted
            for token_id in token_ids:
                if self.detokenizer.stopped:
                    break
                pieces.append(self.detokenizer.add_tokens([token_id]))
                consumed += 1
        elif not self.detokenizer.stopped:
            pieces.append(self.detokenizer.add_tokens(list(token_ids)))
            consumed = len(token_ids)
        self.num_tokens += consumed
        delta = self._parse("".join(pieces), final=False)
        entries = None
        if self.options.logprobs and logprobs is not None:
            entries = openai_logprobs(self.tokenizer, logprobs[:consumed], self.options.top_logprobs)
        return delta._replace(logprobs=entries, num_tokens=consumed)

    def finish(self) -> ChoiceDelta:
        """Flush text held back for a possible stop string and close the parsers."""
        return self._parse(self.detokenizer.finish(), final=True)

    def _parse(self, text: str, *, final: bool) -> ChoiceDelta:
        reasoning: list[str] = []
        content: list[str] = []
        tool_calls: list[ToolCallDelta] = []

        def add_content(piece: str) -> None:
            if self.tools is None:
                content.append(piece)
                return
            for item in self.tools.feed(piece):
                self._collect(item, content, tool_calls)

        if self.reasoning is None:
            if text:
                add_content(text)
        else:
            deltas = self.reasoning.feed(text) if text else []
            if final:
                deltas = [*deltas, *self.reasoning.finish()]
            for delta in deltas:
                if delta.kind == "reasoning":
                    reasoning.append(delta.text)
                else:
                    add_content(delta.text)
        if final and self.tools is not None:
            for item in self.tools.finish():
                self._collect(item, content, tool_calls)
        return ChoiceDelta("".join(reasoning), "".join(content), tool_calls, None, 0)

    def _collect(self, item: Any, content: list[str], tool_calls: list[ToolCallDelta]) -> None:
        if isinstance(item, ToolCallDelta):
            self.num_tool_calls = max(self.num_tool_calls, item.index + 1)
            tool_calls.append(item)
        else:
            content.append(item.text)
