"""A keyed MAC on every KV control and data message, derived from the deployment's
internal token: a KV socket acts only on messages from the deployment's own engines
(raw ZeroMQ frames from anyone else are dropped, and a fake peer's replies are refused).

Replay protection: every message carries a stamp inside its MAC, a session ID and a
sequence number. The receiver issues the session ID (16 random bytes) in its answer to
the sender's HELLO, and accepts each later message of that session only with a sequence
number above the last one it accepted (one ZeroMQ connection keeps the order), so a
captured message sent again, or an older one sent after a newer, is dropped; a message
of a session the receiver did not issue (another run, or one it forgot) is dropped too.
A reply is bound to the request it answers: its MAC covers the request's stamp, and a
HELLO's stamp is the sender's fresh random challenge.

Without an internal token (an open loopback deployment) messages carry no tag and no
stamp and every message is accepted, as before. Not covered: confidentiality (KV
crosses in clear; use a private network or a tunnel across hosts).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

_LABEL = b"splitserve kv frames v1"
TAG_BYTES = 32
SESSION_BYTES = 16
STAMP_BYTES = SESSION_BYTES + 8  # session ID, then the sequence number (big-endian)
# Sessions a receiver remembers; the least recently used is forgotten first (its sender's
# later messages are dropped and its transfers fail over to a recompute). Each send lane
# of each peer holds one, and idle lanes retire, so a deployment needs far fewer.
MAX_SESSIONS = 4096


def _view(frame: Any) -> Any:
    """The bytes of a frame: bytes, a memoryview, or a zmq.Frame (its buffer)."""
    return getattr(frame, "buffer", frame)


def stamp(session: bytes, sequence: int) -> bytes:
    return session + sequence.to_bytes(8, "big")


def hello_stamp() -> bytes:
    """A HELLO's stamp: a fresh challenge its reply must be bound to."""
    return stamp(secrets.token_bytes(SESSION_BYTES), 0)


class FrameMac:
    """`label` separates the keys of different protocols derived from the same token (a
    message of one is never valid in another)."""

    def __init__(self, secret: str | None, label: bytes = _LABEL):
        self._key = hmac.new(secret.encode(), label, hashlib.sha256).digest() if secret else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _tag(self, frames: Sequence[Any]) -> bytes:
        assert self._key is not None
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            view = memoryview(_view(frame)).cast("B")
            mac.update(len(view).to_bytes(8, "big"))  # frame boundaries are part of the message
            mac.update(view)
        return mac.digest()

    def seal(self, frames: list[Any]) -> list[Any]:
        """`frames` with their tag appended (unchanged without a key)."""
        return [*frames, self._tag(frames)] if self._key is not None else frames

    def open(self, frames: list[Any]) -> list[Any] | None:
        """The frames without their tag when it is valid; None when it is not."""
        if self._key is None:
            return frames
        if len(frames) < 2:
            return None
        body, tag = frames[:-1], bytes(_view(frames[-1]))
        return body if hmac.compare_digest(tag, self._tag(body)) else None


class SenderSession:
    """A sender's side of one session (one send lane): the session its peer issued and the
    next sequence number."""

    def __init__(self) -> None:
        self.session = b""
        self._sequence = 0

    def start(self, session: bytes) -> None:
        self.session, self._sequence = session, 0

    def next_stamp(self) -> bytes:
        self._sequence += 1
        return stamp(self.session, self._sequence)


class ReplayGuard:
    """A receiver's sessions: which it issued, and the last sequence number it accepted in
    each. Shared by the receiving thread only, but locked for the metrics reader."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._last: OrderedDict[bytes, int] = OrderedDict()
        self.refused = 0

    def issue(self) -> bytes:
        session = secrets.token_bytes(SESSION_BYTES)
        with self._lock:
            self._last[session] = 0
            while len(self._last) > self.max_sessions:
                self._last.popitem(last=False)
        return session

    def admit(self, message_stamp: bytes) -> bool:
        """Whether a message with this stamp is new: of an issued session, and later than
        every message of that session accepted before."""
        if len(message_stamp) != STAMP_BYTES:
            return self._refuse()
        session = message_stamp[:SESSION_BYTES]
        sequence = int.from_bytes(message_stamp[SESSION_BYTES:], "big")
        with self._lock:
            last = self._last.get(session)
            if last is None or sequence <= last:
                self.refused += 1
                return False
            self._last[session] = sequence
            self._last.move_to_end(session)
        return True

    def _refuse(self) -> bool:
        with self._lock:
            self.refused += 1
        return False
