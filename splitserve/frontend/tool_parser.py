"""Hermes-style tool-call parser (Qwen, Hermes): `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

A state machine fed each new piece of text once. Outside a call it looks for `<tool_call>`
(holding back a possible prefix of the tag and trailing whitespace). Inside a call,
`ToolCallScanner` follows the JSON object's strings, escapes and nesting depth, so a
`</tool_call>` written inside a JSON string does not end the call: the call ends at the
`</tool_call>` that follows the closing brace of the top-level object. Once the name
is known, the `arguments` value is streamed as it arrives, byte for byte as the model wrote
it; the argument text already sent is never kept.

Rules worth knowing:
- Whitespace between the content and a `<tool_call>`, between two calls, and after the
  last call is not content; all other text before, between and after calls is content,
  verbatim (so an output with no tool call is returned unchanged).
- A call with no `arguments` key gets `"{}"`.
- Malformed calls: if the text after `<tool_call>` is not a JSON object whose `name` is a
  string (or the stream ends before the name and `arguments` are known), the raw text from
  `<tool_call>` on is returned as content, at the point the problem is seen or at `finish()`.
  Once a call's first delta has gone out it cannot be taken back: the arguments are passed
  through unvalidated (as vLLM does), a call cut short stays cut short, and text after a
  broken object is content. Keys are compared as written: a key spelled with escapes
  (`"na\\u006de"`) is not `name`.
- Before a call's name is known, its raw text (and arguments written before the name) is
  buffered: that is the only state that grows with the output, and only in that case.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from splitserve.frontend.tool_call_scanner import ToolCallScanner
from splitserve.protocol.openai_chunks import ToolCallDelta

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_WS = " \t\n\r"
_MODES = ("content", "call", "close")


class ContentDelta(NamedTuple):
    text: str


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str


def tool_call_id(salt: str, index: int) -> str:
    """Deterministic id: the same request salt and call index give the same id on any replica."""
    digest = hashlib.blake2b(f"{salt}\x00{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def _partial_suffix(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Out:
    def __init__(self) -> None:
        self.deltas: list[ContentDelta | ToolCallDelta] = []

    def content(self, text: str) -> None:
        if not text:
            return
        last = self.deltas[-1] if self.deltas else None
        if isinstance(last, ContentDelta):
            self.deltas[-1] = ContentDelta(last.text + text)
        else:
            self.deltas.append(ContentDelta(text))

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        last = self.deltas[-1] if self.deltas else None
        if isinstance(last, ToolCallDelta) and last.index == index:
            self.deltas[-1] = last._replace(arguments=last.arguments + arguments)
        elif call_id is not None or arguments:
            self.deltas.append(ToolCallDelta(index, call_id, name, arguments))


class HermesToolParser:
    def __init__(self, *, id_salt: str = "") -> None:
        self.id_salt = id_salt
        self.index = 0  # index of the current (or next) call
        self.mode = "content"  # "content" | "call" (inside the JSON) | "close" (after it)
        self.ws = ""  # content: trailing whitespace held back (dropped if a call follows)
        self.tag = ""  # content: a possible prefix of <tool_call>
        self.after_call = False  # content: the held whitespace follows a call (dropped at the end)
        self.call: ToolCallScanner | None = None  # call: the JSON object's scanner
        self.raw = ""  # call: raw text since <tool_call> until the call starts (for the fallback)
        self.close_matched = 0  # close: characters of </tool_call> seen
        self.chars_examined = 0  # work counter (tests prove it stays linear)

    # ---- public ----
    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        out = _Out()
        pos, n = 0, len(text)
        self.chars_examined += n
        while pos < n:
            if self.mode == "content":
                pos = self._scan_content(text, pos, out)
            elif self.mode == "call":
                pos = self._scan_call(text, pos, out)
            else:
                pos = self._scan_close(text, pos, out)
        return out.deltas

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """End of the output: release held text; a call that never started is content."""
        out = _Out()
        if self.mode == "content":
            # whitespace that only trails a tool call is not content
            out.content(self.ws + self.tag if self.tag or not self.after_call else "")
        elif self.mode == "call" and self.call is not None and not self.call.started:
            out.content(self.raw)
        self._to_content(after_call=False)
        return out.deltas

    # ---- content ----
    def _scan_content(self, text: str, pos: int, out: _Out) -> int:
        """Scan text[pos:] outside a call; returns where the scan stopped (a call began there)."""
        n = len(text)
        if self.tag:  # does the text complete the held prefix of <tool_call>?
            head = self.tag + text[pos : pos + len(OPEN_TAG)]
            self.chars_examined += len(head)
            if head.startswith(OPEN_TAG):
                return self._enter_call(self.ws, pos + len(OPEN_TAG) - len(self.tag))
            if OPEN_TAG.startswith(head):
                self.tag = head
                return n
            out.content(self.ws + self.tag)  # it was text after all
            self.ws, self.tag, self.after_call = "", "", False
        at = text.find(OPEN_TAG, pos)
        if at >= 0:
            before = text[pos:at]
            body = before.rstrip()
            dropped = before[len(body) :]
            if body:
                out.content(self.ws + body)
            else:
                dropped = self.ws + dropped
            return self._enter_call(dropped, at + len(OPEN_TAG))
        keep = _partial_suffix(text, OPEN_TAG, pos)
        body = text[pos : n - keep]
        self.tag = text[n - keep :] if keep else ""
        stripped = body.rstrip()
        if stripped:
            out.content(self.ws + stripped)
            self.ws = body[len(stripped) :]
            self.after_call = False
        else:
            self.ws += body
        return n

    def _enter_call(self, dropped_ws: str, pos: int) -> int:
        self.mode, self.call = "call", ToolCallScanner()
        self.ws, self.tag = "", ""
        self.raw = dropped_ws + OPEN_TAG
        return pos

    def _to_content(self, *, after_call: bool) -> None:
        self.mode, self.call, self.raw, self.close_matched = "content", None, "", 0
        self.ws, self.tag, self.after_call = "", "", after_call

    # ---- inside <tool_call> ----
    def _scan_call(self, text: str, pos: int, out: _Out) -> int:
        call = self.call
        assert call is not None
        was_started = call.started
        result = call.scan(text, pos)
        if call.started:
            if not was_started:
                out.call(self.index, tool_call_id(self.id_salt, self.index), call.name, result.arguments)
                self.raw = ""
            else:
                out.call(self.index, None, None, result.arguments)
        else:
            self.raw += text[pos : result.pos]
        if result.status == "done":
            self.mode, self.call, self.close_matched = "close", None, 0
        elif result.status == "broken":
            # Not started: its raw text is content. Started: it cannot be taken back, so it
            # just ends. Either way the text from the bad character on is content.
            if call.started:
                self.index += 1
            else:
                out.content(self.raw)
            self._to_content(after_call=False)
        return result.pos

    def _scan_close(self, text: str, pos: int, out: _Out) -> int:
        """After the object: whitespace, then </tool_call>."""
        n = len(text)
        while pos < n:
            c = text[pos]
            if self.close_matched == 0 and c in _WS:
                pos += 1
                continue
            if c != CLOSE_TAG[self.close_matched]:
                # No closing tag: what follows the object is content. A lone "<" may
                # still open the next call.
                partial = CLOSE_TAG[: self.close_matched]
                self.index += 1
                self._to_content(after_call=False)
                if partial == "<":
                    self.tag = partial
                else:
                    out.content(partial)
                return pos
            self.close_matched += 1
            pos += 1
            if self.close_matched == len(CLOSE_TAG):
                self.index += 1
                self._to_content(after_call=True)
                return pos
        return n

    # ---- compact state ----
    def state(self) -> dict[str, Any]:
        """JSON-able; holds no argument text that was already sent."""
        state: dict[str, Any] = {"id_salt": self.id_salt, "index": self.index, "mode": self.mode}
        if self.mode == "content":
            state.update(ws=self.ws, tag=self.tag, after_call=self.after_call)
        elif self.mode == "call" and self.call is not None:
            state.update(raw=self.raw, call=self.call.state())
        else:
            state["close_matched"] = self.close_matched
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> HermesToolParser:
        """Rebuild from `state()`. Raises ValueError on a malformed state."""
        if not isinstance(state, dict):
            raise ValueError("invalid tool parser state")
        parser = cls()
        fields: dict[str, Any] = {"id_salt": str, "index": int, "mode": str}
        mode = state.get("mode")
        if mode == "content":
            fields.update(ws=str, tag=str, after_call=bool)
        elif mode == "call":
            fields.update(raw=str, call=dict)
        else:
            fields["close_matched"] = int
        for name, kind in fields.items():
            value = state.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"invalid tool parser state: {name}")
            setattr(parser, name, value)
        if (
            parser.mode not in _MODES
            or parser.index < 0
            or not 0 <= parser.close_matched < len(CLOSE_TAG)
            or len(parser.tag) >= len(OPEN_TAG)
            or not OPEN_TAG.startswith(parser.tag)
            or parser.ws.strip()
        ):
            raise ValueError("invalid tool parser state")
        if mode == "call":
            parser.call = ToolCallScanner.from_state(state["call"])
        return parser


def parse_tool_calls(text: str, *, id_salt: str = "") -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: (content or None, calls), equal to the streamed deltas joined."""
    parser = HermesToolParser(id_salt=id_salt)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            entry = calls.setdefault(d.index, [d.id or "", d.name or "", ""])
            entry[2] += d.arguments
    return (content or None), [ToolCall(*calls[i]) for i in sorted(calls)]
