"""An incremental scanner for one tool call's JSON object: `{"name": ..., "arguments": ...}`.

Fed each new piece of text once, it tracks only the structure it needs (the current
top-level key, whether it is inside a string or after a backslash, the nesting depth of
the current value) and jumps over runs of ordinary characters with a regex, so a long
argument costs C speed, not a Python step per character. It reports the name once known
and the argument text as it arrives, exactly as written; it never keeps argument text
that was reported. The object ends at the brace that closes the top level, whatever
strings inside it contain.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

_WS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["\\{}\[\]]')
_SCALAR_STOP = re.compile(r"[ \t\n\r,}\]]")
_MAX_KEY = 16  # longer keys are none of the ones we look for
PHASES = ("open", "key", "in_key", "colon", "value", "in_value", "after")
_VALUE_KINDS = ("", "string", "nested", "scalar")
_TARGETS = ("", "name", "args", "skip")


class ScanResult(NamedTuple):
    pos: int  # where the scan stopped: len(text), past the closing brace, or at a bad character
    status: str  # "more" (the text ran out), "done" (the object closed), "broken"
    arguments: str  # argument text to report from this scan (only once `started`)


class ToolCallScanner:
    """State of one call's JSON object. `started` turns true once the call can be reported:
    its name is known and its arguments began (or the object closed without arguments,
    which reports "{}"). Arguments written before the name are held until then."""

    _FIELDS: tuple[tuple[str, Any], ...] = (
        ("phase", str), ("key", str), ("esc", bool), ("vkind", str), ("vdepth", int),
        ("vstr", bool), ("target", str), ("name_raw", str), ("name", (str, type(None))),
        ("has_args", bool), ("args_pending", str), ("started", bool),
    )  # fmt: skip

    def __init__(self) -> None:
        self.phase = "open"
        self.key = ""
        self.esc = False  # inside a string, after a backslash
        self.vkind = ""  # kind of the current value: "string" | "nested" | "scalar"
        self.vdepth = 0  # nesting depth inside the current value
        self.vstr = False  # inside a string nested in the current value
        self.target = ""  # what the current value is: "name" | "args" | "skip"
        self.name_raw = ""  # the name's JSON text while it arrives
        self.name: str | None = None
        self.has_args = False
        self.args_pending = ""  # arguments written before the name
        self.started = False

    def scan(self, text: str, pos: int) -> ScanResult:
        n = len(text)
        i = seg = pos  # seg: where the current value's text starts in `text`
        args: list[str] = []
        while i < n:
            phase = self.phase
            if phase == "in_value":
                if self.esc:  # the character after a backslash, in a string
                    self.esc = False
                    i += 1
                    continue
                in_string = self.vkind == "string" or self.vstr
                if in_string:
                    m = _STRING_STOP.search(text, i)
                elif self.vkind == "nested":
                    m = _NESTED_STOP.search(text, i)
                else:
                    m = _SCALAR_STOP.search(text, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                c = text[j]
                if in_string:
                    i = j + 1
                    if c == "\\":
                        self.esc = True
                        continue
                    if self.vkind == "nested":  # a string inside the value closed
                        self.vstr = False
                        continue
                elif self.vkind == "nested":
                    i = j + 1
                    if c == '"':
                        self.vstr = True
                        continue
                    if c == "\\":  # not JSON: what came before it was sent when streamed
                        self._take(text[seg:j], args)
                        return ScanResult(j, "broken", "".join(args))
                    self.vdepth += 1 if c in "{[" else -1
                    if self.vdepth > 0:
                        continue
                else:
                    i = j  # a scalar ends before its terminator
                self._take(text[seg:i], args)
                if not self._value_done(args):
                    return ScanResult(i, "broken", "".join(args))
                continue

            c = text[i]
            if phase == "in_key":
                if self.esc:
                    self.esc = False
                    self.key = (self.key + c)[:_MAX_KEY]
                    i += 1
                    continue
                m = _STRING_STOP.search(text, i)
                j = m.start() if m else n
                self.key = (self.key + text[i:j])[:_MAX_KEY]
                if m is None:
                    i = n
                    break
                if text[j] == "\\":
                    self.esc = True
                    self.key = (self.key + "\\")[:_MAX_KEY]
                else:
                    self.phase = "colon"
                i = j + 1
                continue
            if c in _WS:
                i += 1
                continue
            if phase == "open":
                if c != "{":
                    return ScanResult(i, "broken", "")
                self.phase = "key"
            elif phase == "key":
                if c == '"':
                    self.phase, self.key = "in_key", ""
                elif c == "}":
                    return self._closed(i, args)
                else:
                    return ScanResult(i, "broken", "".join(args))
            elif phase == "colon":
                if c != ":":
                    return ScanResult(i, "broken", "".join(args))
                self.phase = "value"
            elif phase == "value":
                if c in ",}]:":
                    return ScanResult(i, "broken", "".join(args))
                self._start_value(c, args)
                seg = i
                if self.vkind == "scalar":
                    continue  # scanned from its first character
            elif phase == "after":
                if c == ",":
                    self.phase = "key"
                elif c == "}":
                    return self._closed(i, args)
                else:
                    return ScanResult(i, "broken", "".join(args))
            i += 1
        if self.phase == "in_value":
            self._take(text[seg:n], args)
        return ScanResult(n, "more", "".join(args))

    def _start_value(self, first: str, args: list[str]) -> None:
        if self.key == "name" and self.name is None and not self.name_raw:
            self.target = "name"
        elif self.key == "arguments" and not self.has_args:
            self.target, self.has_args = "args", True
            self.started = self.started or self.name is not None
        else:
            self.target = "skip"
        self.vkind = "string" if first == '"' else "nested" if first in "{[" else "scalar"
        self.vdepth, self.vstr = (1 if first in "{[" else 0), False
        self.phase = "in_value"

    def _take(self, chunk: str, args: list[str]) -> None:
        if not chunk:
            return
        if self.target == "name":
            self.name_raw += chunk
        elif self.target == "args":
            if self.started:
                args.append(chunk)
            else:
                self.args_pending += chunk

    def _value_done(self, args: list[str]) -> bool:
        """A value just ended; False if that makes the call malformed."""
        if self.target == "name":
            try:
                name = json.loads(self.name_raw)
            except ValueError:
                return False
            if not isinstance(name, str):
                return False
            self.name, self.name_raw = name, ""
            if self.has_args:  # the arguments came first: report them now
                self.started = True
                args.append(self.args_pending)
                self.args_pending = ""
        self.phase = "after"
        return True

    def _closed(self, at: int, args: list[str]) -> ScanResult:
        if self.name is None:
            return ScanResult(at, "broken", "".join(args))
        if not self.started:
            self.started = True
            args.append("{}")
        return ScanResult(at + 1, "done", "".join(args))

    # ---- compact state ----
    def state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name, _ in self._FIELDS}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ToolCallScanner:
        """Rebuild from `state()`. Raises ValueError on a malformed state."""
        if not isinstance(state, dict):
            raise ValueError("invalid tool call scanner state")
        scanner = cls()
        for name, kind in cls._FIELDS:
            value = state.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"invalid tool call scanner state: {name}")
            setattr(scanner, name, value)
        if (
            scanner.phase not in PHASES
            or scanner.vkind not in _VALUE_KINDS
            or scanner.target not in _TARGETS
            or scanner.vdepth < 0
        ):
            raise ValueError("invalid tool call scanner state")
        return scanner
