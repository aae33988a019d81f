"""Qwen3-style reasoning parser: `<think>reasoning</think>content`, streamed.

A state machine fed each new piece of text once. It holds back only what it cannot yet
classify: a possible prefix of a tag (at most 7 characters) and, inside the reasoning, a
count of trailing newlines (they are dropped if `</think>` follows). Its state is a few
fields, whatever the length of the output.

Rules (as Qwen3 and its chat template): reasoning starts when the output opens with
`<think>` (or at once with `starts_in_reasoning`, when the prompt already opened it) and
ends at `</think>`; newlines right after `<think>`, right before `</think>` and right after
`</think>` are dropped; an output that does not start with `<think>` is all content; a
reasoning cut short (no `</think>`) stays reasoning.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

THINK_START = "<think>"
THINK_END = "</think>"
_MODES = ("await", "reasoning", "content")


class Delta(NamedTuple):
    kind: Literal["reasoning", "content"]
    text: str


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Out:
    """Collects deltas, merging neighbours of the same kind and dropping empty text."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []

    def add(self, kind: Literal["reasoning", "content"], text: str) -> None:
        if not text:
            return
        if self.deltas and self.deltas[-1].kind == kind:
            self.deltas[-1] = Delta(kind, self.deltas[-1].text + text)
        else:
            self.deltas.append(Delta(kind, text))


class ReasoningParser:
    def __init__(self, *, starts_in_reasoning: bool) -> None:
        self.mode = "reasoning" if starts_in_reasoning else "await"
        self.held = ""  # a possible prefix of the tag the current mode looks for
        self.newlines = 0  # trailing newlines held inside the reasoning
        self.strip_leading = starts_in_reasoning  # drop newlines at the start of a section
        self.chars_examined = 0  # work counter (tests prove it stays linear)

    def feed(self, text: str) -> list[Delta]:
        out = _Out()
        self._feed(text, out)
        return out.deltas

    def _feed(self, text: str, out: _Out) -> None:
        while text:
            self.chars_examined += len(text) + len(self.held)
            if self.mode == "await":
                text = self._await(text)
            elif self.mode == "reasoning":
                text = self._reasoning(text, out)
            else:
                if self.strip_leading:
                    text = text.lstrip("\n")
                    self.strip_leading = not text
                out.add("content", text)
                return

    def _await(self, text: str) -> str:
        buf = self.held + text
        self.held = ""
        if buf.startswith(THINK_START):
            self.mode, self.strip_leading = "reasoning", True
            return buf[len(THINK_START) :]
        if THINK_START.startswith(buf):
            self.held = buf
            return ""
        self.mode = "content"
        return buf

    def _reasoning(self, text: str, out: _Out) -> str:
        buf = self.held + text
        self.held = ""
        end = buf.find(THINK_END)
        if end >= 0:
            body = buf[:end].rstrip("\n")
            if self.strip_leading:
                body = body.lstrip("\n")
            if body:
                out.add("reasoning", "\n" * self.newlines + body)
            self.newlines = 0
            self.mode, self.strip_leading = "content", True
            return buf[end + len(THINK_END) :]
        keep = _partial_suffix(buf, THINK_END)
        body = buf[: len(buf) - keep]
        self.held = buf[len(buf) - keep :]
        if self.strip_leading:
            body = body.lstrip("\n")
            if not body:
                return ""
            self.strip_leading = False
        stripped = body.rstrip("\n")
        if stripped:
            out.add("reasoning", "\n" * self.newlines + stripped)
            self.newlines = len(body) - len(stripped)
        else:
            self.newlines += len(body)
        return ""

    def finish(self) -> list[Delta]:
        out = _Out()
        if self.mode == "await":
            out.add("content", self.held)
        elif self.mode == "reasoning" and self.held:
            out.add("reasoning", "\n" * self.newlines + self.held)
        self.held, self.newlines = "", 0
        self.mode = "content"
        self.strip_leading = False
        return out.deltas

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode, "held": self.held, "newlines": self.newlines, "strip": self.strip_leading}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ReasoningParser:
        """Rebuild from `state()`. Raises ValueError on a malformed state."""
        if not isinstance(state, dict):
            raise ValueError("invalid reasoning parser state")
        mode, held = state.get("mode"), state.get("held")
        newlines, strip = state.get("newlines"), state.get("strip")
        tag = THINK_START if mode == "await" else THINK_END
        if (
            mode not in _MODES
            or not isinstance(held, str)
            or len(held) >= len(tag)
            or not isinstance(newlines, int)
            or isinstance(newlines, bool)
            or newlines < 0
            or not isinstance(strip, bool)
        ):
            raise ValueError("invalid reasoning parser state")
        parser = cls(starts_in_reasoning=False)
        parser.mode, parser.held, parser.newlines, parser.strip_leading = mode, held, newlines, strip
        return parser


def parse_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str]:
    """Non-streaming: (reasoning or None, content), equal to the streamed deltas joined."""
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    deltas = parser.feed(text) + parser.finish()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    return (reasoning or None), content
