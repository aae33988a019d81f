"""OpenAI chat and completions output shapes, built from decoded deltas.

A `ChoiceDelta` is what one choice's way back (frontend/choice_decoder.py) makes of new
token IDs: reasoning, content, tool-call pieces and logprobs. Every tier that answers in
OpenAI shapes (the OpenAI service of `serve` and of the proxy, the render tier's
derender endpoint) builds its chunks and messages from deltas with these functions; the
internal derender endpoint carries deltas on the wire (`delta_to_wire`/`delta_from_wire`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class ToolCallDelta(NamedTuple):
    index: int
    id: str | None
    name: str | None
    arguments: str


class ChoiceDelta(NamedTuple):
    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]
    logprobs: list[dict] | None  # OpenAI chat logprobs entries for the tokens consumed
    num_tokens: int  # tokens consumed (tokens after a stop string are not)


def merge_deltas(first: ChoiceDelta, second: ChoiceDelta) -> ChoiceDelta:
    logprobs = first.logprobs if second.logprobs is None else (first.logprobs or []) + second.logprobs
    return ChoiceDelta(
        first.reasoning + second.reasoning,
        first.content + second.content,
        first.tool_calls + second.tool_calls,
        logprobs,
        first.num_tokens + second.num_tokens,
    )


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; with `cached_tokens` (prompt tokens not computed for this request)
    also `prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report it."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def delta_dict(delta: ChoiceDelta, *, role: bool) -> dict[str, Any]:
    """The `delta` object of a chat.completion.chunk choice."""
    out: dict[str, Any] = {}
    if role:
        out["role"] = "assistant"
    if delta.reasoning:
        out["reasoning"] = delta.reasoning
        out["reasoning_content"] = delta.reasoning  # the older field name some clients read
    if delta.content or (role and not delta.reasoning and not delta.tool_calls):
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for call in delta.tool_calls:
            item: dict[str, Any] = {"index": call.index}
            function: dict[str, Any] = {}
            if call.id is not None:
                item["id"] = call.id
                item["type"] = "function"
            if call.name is not None:
                function["name"] = call.name
            if call.arguments:
                function["arguments"] = call.arguments
            item["function"] = function
            calls.append(item)
        out["tool_calls"] = calls
    return out


def chunk_choice(
    index: int,
    delta: ChoiceDelta,
    *,
    role: bool,
    finish_reason: str | None,
    token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta_dict(delta, role=role),
        "logprobs": {"content": delta.logprobs} if delta.logprobs else None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


class MessageAssembler:
    """Collects one choice's deltas into a non-streaming `message`."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.reasoning.append(delta.reasoning)
        self.content.append(delta.content)
        for call in delta.tool_calls:
            entry = self.calls.setdefault(
                call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.id is not None:
                entry["id"] = call.id
            if call.name is not None:
                entry["function"]["name"] = call.name
            if call.arguments:
                entry["function"]["arguments"] += call.arguments
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs

    def choice(
        self, index: int, finish_reason: str, token_ids: Sequence[int] | None = None
    ) -> dict[str, Any]:
        reasoning = "".join(self.reasoning)
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self.calls else None,
            "reasoning": reasoning or None,
            "reasoning_content": reasoning or None,
        }
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
            "finish_reason": finish_reason,
        }
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return choice


def delta_to_wire(delta: ChoiceDelta) -> dict[str, Any]:
    return {
        "reasoning": delta.reasoning,
        "content": delta.content,
        "tool_calls": [call._asdict() for call in delta.tool_calls],
        "logprobs": delta.logprobs,
        "num_tokens": delta.num_tokens,
    }


def delta_from_wire(data: dict[str, Any]) -> ChoiceDelta:
    return ChoiceDelta(
        str(data.get("reasoning") or ""),
        str(data.get("content") or ""),
        [ToolCallDelta(**call) for call in data.get("tool_calls") or []],
        data.get("logprobs"),
        int(data.get("num_tokens") or 0),
    )


def completion_logprobs(entries: list[dict]) -> dict[str, Any]:
    """Chat-style entries → the legacy completions logprobs object."""
    offset = 0
    text_offset = []
    for entry in entries:
        text_offset.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": text_offset,
    }
