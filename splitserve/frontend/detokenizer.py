"""Incremental detokenization with stop strings, in O(new tokens) per call and O(1) state.

Two ways to turn new token IDs into new text, both equal to `tokenizer.decode(all_ids)`:
- ByteLevel tokenizers (GPT-2, Llama 3, Qwen): decode is the UTF-8 decoding (errors
  replaced) of the concatenated token bytes, so only the bytes of an unfinished character
  (at most 3) are carried between calls.
- Any other tokenizer: vLLM's offset window (decode the tokens since the last emitted text,
  with the previous ones as context, and emit only when the text does not end in U+FFFD).

Stop strings: the text that could still be the start of a stop string is held back (at
most the longest stop string minus one character); when one matches, the text is cut
before it (or after it, with include_stop_str_in_output) and nothing more is produced.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from splitserve.frontend.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# The generic window emits anyway past this many undecodable tokens (invalid bytes), so
# that the state stays bounded.
_MAX_PENDING_TOKENS = 16
_STATE_VERSION = 1


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if isinstance(stop, str):
            stop = (stop,)
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._byte_level = tokenizer.byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # Generic path: token window, [prefix, read) is already-emitted context.
        self._window: list[int] = []
        self._prefix = 0
        self._read = 0
        self.held = ""  # produced text that could still start a stop string
        self.stopped: str | None = None
        self.finished = False

    # ---- decoding new tokens ----
    def add_tokens(self, ids: Sequence[int]) -> str:
        """The new text these tokens complete (possibly empty)."""
        if self.stopped is not None or self.finished:
            return ""
        text = self._decode_bytes(ids) if self._byte_level else self._decode_window(ids)
        return self._through_stop(text)

    def finish(self) -> str:
        """Flush what was held back (an unfinished character becomes U+FFFD, as decode does)."""
        if self.stopped is not None or self.finished:
            return ""
        if self._byte_level:
            text = self._utf8.decode(b"", final=True)
        else:
            text = self._flush_window()
        out = self._through_stop(text)
        if self.stopped is None:
            out += self.held
            self.held = ""
        self.finished = True
        return out

    def _decode_bytes(self, ids: Sequence[int]) -> str:
        skip = self.tokenizer.special_token_ids if self.skip_special_tokens else ()
        token_bytes = self.tokenizer.token_bytes
        data = b"".join(token_bytes(i) for i in ids if i not in skip)
        return self._utf8.decode(data)

    def _decode_window(self, ids: Sequence[int]) -> str:
        self._window.extend(ids)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self._window[self._prefix : self._read], skip)
        after = decode(self._window[self._prefix :], skip)
        pending = len(self._window) - self._read
        if len(after) > len(before) and (not after.endswith(_REPLACEMENT) or pending > _MAX_PENDING_TOKENS):
            text = after[len(before) :]
            self._window = self._window[self._read :]
            self._prefix, self._read = 0, len(self._window)
            return text
        if pending > _MAX_PENDING_TOKENS:  # nothing printable yet: keep the window bounded
            self._window = self._window[self._read :]
            self._prefix, self._read = 0, 0
        return ""

    def _flush_window(self) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self._window[self._prefix : self._read], skip)
        after = decode(self._window[self._prefix :], skip)
        self._window, self._prefix, self._read = [], 0, 0
        return after[len(before) :] if after.startswith(before) else after

    # ---- stop strings ----
    def _through_stop(self, text: str) -> str:
        if not self.stop:
            return text
        if not text:
            return ""
        buf = self.held + text
        first = None
        for s in self.stop:
            at = buf.find(s)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            at, s = first
            self.stopped = s
            self.held = ""
            return buf[: at + len(s)] if self.include_stop_str_in_output else buf[:at]
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    # ---- compact state ----
    def state(self) -> dict[str, Any]:
        """JSON-able state; its size is bounded (no output history)."""
        pending, _ = self._utf8.getstate()
        state: dict[str, Any] = {"v": _STATE_VERSION, "held": self.held}
        if self._byte_level:
            state["pending"] = pending.hex()
        else:
            state["window"] = self._window[self._prefix :]
            state["read"] = self._read - self._prefix
        if self.stopped is not None:
            state["stopped"] = self.stopped
        if self.finished:
            state["finished"] = True
        return state

    @classmethod
    def from_state(
        cls,
        tokenizer: Tokenizer,
        state: dict[str, Any],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> IncrementalDetokenizer:
        """Rebuild from `state()`; the options must be the ones the state was made with.
        Raises ValueError on a malformed state."""
        detok = cls(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        try:
            if not isinstance(state, dict) or state.get("v") != _STATE_VERSION:
                raise ValueError("unknown detokenizer state version")
            held = state.get("held", "")
            stopped = state.get("stopped")
            if not isinstance(held, str) or not (stopped is None or isinstance(stopped, str)):
                raise ValueError("bad held/stopped")
            detok.held, detok.stopped = held, stopped
            detok.finished = bool(state.get("finished", False))
            if detok._byte_level:
                pending = bytes.fromhex(state.get("pending", ""))
                if len(pending) > 3:
                    raise ValueError("too many pending bytes")
                detok._utf8.setstate((pending, 0))
            else:
                window, read = state.get("window", []), state.get("read", 0)
                if not (isinstance(window, list) and all(isinstance(i, int) for i in window)):
                    raise ValueError("bad window")
                if not (isinstance(read, int) and 0 <= read <= len(window)):
                    raise ValueError("bad read offset")
                detok._window, detok._prefix, detok._read = list(window), 0, read
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"invalid detokenizer state: {exc}") from exc
        return detok
