"""What the benchmark sends: synthetic prompts of exact token lengths, shared-prefix groups,
multi-turn sessions, or chats replayed from a JSONL file.

Exact lengths come from the server's own tokenizer (a local model directory's
tokenizer.json, read with the `tokenizers` library). Prompts are built from "safe words":
vocabulary entries that are one token both on their own and after a space, so a prompt of
n such words joined by spaces is exactly n tokens (pre-tokenizers split at spaces, and BPE
merges never cross that split). Every prompt is checked by encoding it again.
Without a tokenizer, prompts are words from a fixed list and lengths are approximate.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from splitserve.goodput import Lengths

_FALLBACK_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education"
).split()
_MAX_CANDIDATES = 20000
_MAX_SAFE_WORDS = 2000


class Tokenizer:
    """A local model directory's tokenizer.json, for counting and building prompts."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(directory)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json in {directory}")
        self._tokenizer = HFTokenizer.from_file(str(file))

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def safe_words(self, seed: int = 0) -> list[str]:
        """Words that are a single token alone and after a space (see the module docstring)."""
        vocab = sorted(self._tokenizer.get_vocab().values())
        random.Random(seed).shuffle(vocab)
        words = set()
        for token_id in vocab[:_MAX_CANDIDATES]:
            word = self._tokenizer.decode([token_id]).strip()
            if word.isascii() and word.isalpha():
                words.add(word)
        candidates = sorted(words)
        alone = self._tokenizer.encode_batch(candidates, add_special_tokens=False)
        spaced = self._tokenizer.encode_batch([" " + w for w in candidates], add_special_tokens=False)
        safe = [
            w
            for w, a, b in zip(candidates, alone, spaced, strict=True)
            if len(a.ids) == 1 and len(b.ids) == 1
        ]
        return safe[:_MAX_SAFE_WORDS]


class PromptFactory:
    """Random texts of an exact number of tokens (approximate without a tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None, seed: int) -> None:
        self.tokenizer = tokenizer
        self.exact = tokenizer is not None
        self._rng = random.Random(seed)
        words = tokenizer.safe_words(seed) if tokenizer is not None else list(_FALLBACK_WORDS)
        if len(words) < 8:
            raise ValueError("the tokenizer has too few single-token words to build prompts")
        self._words = words

    def text(self, num_tokens: int) -> str:
        text = " ".join(self._rng.choice(self._words) for _ in range(num_tokens))
        if self.tokenizer is not None and (got := self.tokenizer.count(text)) != num_tokens:
            raise RuntimeError(f"built a {num_tokens}-token prompt that encodes to {got} tokens")
        return text

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return self.tokenizer.count(text)
        return len(text.split())


class Turn(NamedTuple):
    """One request of a session: the new user text and how many tokens to generate."""

    user_text: str
    user_tokens: int
    max_tokens: int


class Session(NamedTuple):
    """A conversation: `history` (messages sent before the first turn, possibly empty), then
    turns sent one after another, each resending the whole conversation so far."""

    index: int
    history: tuple[dict, ...]
    history_tokens: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class SyntheticSpec:
    input_len: Lengths
    output_len: Lengths
    prefix_len: int = 0
    num_prefix_groups: int = 1
    turns: int = 1


class SessionFactory:
    """Produces sessions on demand (index 0, 1, 2, ...), deterministically from the seed."""

    def __init__(
        self,
        prompts: PromptFactory,
        spec: SyntheticSpec,
        seed: int,
        dataset: Sequence[Session] | None = None,
    ) -> None:
        self.prompts = prompts
        self.spec = spec
        self._rng = random.Random(seed + 1)
        self._dataset = list(dataset) if dataset is not None else None
        self._prefixes = (
            [prompts.text(spec.prefix_len) for _ in range(spec.num_prefix_groups)] if spec.prefix_len else []
        )

    @property
    def turns_per_session(self) -> int:
        return 1 if self._dataset is not None else self.spec.turns

    def session(self, index: int) -> Session:
        if self._dataset is not None:
            recorded = self._dataset[index % len(self._dataset)]
            return recorded._replace(index=index)
        turns = []
        for turn_index in range(self.spec.turns):
            length = self.spec.input_len.sample(self._rng)
            text = self.prompts.text(length)
            if turn_index == 0 and self._prefixes:
                # Groups are assigned round-robin so each holds the same share of requests.
                text = self._prefixes[index % len(self._prefixes)] + " " + text
                length += self.spec.prefix_len
            turns.append(Turn(text, length, self.spec.output_len.sample(self._rng)))
        return Session(index, (), 0, tuple(turns))


def load_dataset(path: str | Path, prompts: PromptFactory, output_len: Lengths, seed: int) -> list[Session]:
    """Chats from a JSONL file, one request a line, in a seeded random order.

    A line holds `messages` (OpenAI chat format), `conversations` (ShareGPT: from/value)
    or `prompt` (a string). A trailing assistant message is the recorded answer: it is
    dropped, and its token count becomes the output length unless the line gives
    `max_tokens`. Otherwise the output length comes from --output-len.
    """
    rng = random.Random(seed + 2)
    sessions: list[Session] = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                sessions.append(_session_from_line(json.loads(line), prompts, output_len, rng))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ValueError(f"{path}:{line_number}: {exc}") from None
    if not sessions:
        raise ValueError(f"{path}: no requests in the dataset")
    rng.shuffle(sessions)
    return sessions


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _session_from_line(
    data: dict, prompts: PromptFactory, output_len: Lengths, rng: random.Random
) -> Session:
    if "prompt" in data:
        if not isinstance(data["prompt"], str):
            raise ValueError("'prompt' must be a string")
        messages = [{"role": "user", "content": data["prompt"]}]
    elif "messages" in data:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]]
    elif "conversations" in data:
        messages = [
            {"role": _SHAREGPT_ROLES[str(m["from"]).lower()], "content": str(m["value"])}
            for m in data["conversations"]
        ]
    else:
        raise ValueError("a line needs 'messages', 'conversations' or 'prompt'")
    max_tokens = data.get("max_tokens")
    if messages and messages[-1]["role"] == "assistant":
        answer = messages.pop()
        if max_tokens is None:
            max_tokens = max(1, prompts.count(answer["content"]))
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("the conversation must end with a user message (or a user message then the answer)")
    last = messages.pop()
    history_tokens = sum(prompts.count(m["content"]) for m in messages)
    max_tokens = int(max_tokens) if max_tokens is not None else output_len.sample(rng)
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    turn = Turn(last["content"], prompts.count(last["content"]), max_tokens)
    return Session(0, tuple(messages), history_tokens, (turn,))


def sessions_needed(num_requests: int, turns: int) -> int:
    return math.ceil(num_requests / turns)
