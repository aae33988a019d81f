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
# Sessions a receiver remembers, per peer (one connection) and in all: a peer's least
# recently used session is forgotten first (its sender's later messages are dropped and its
# transfers fail over to a recompute), and past MAX_PEERS the least recently active peer.
# A send lane says HELLO once per connection, and idle lanes retire, so a deployment needs
# one session per peer and far fewer peers.
MAX_SESSIONS_PER_PEER = 16
MAX_PEERS = 1024


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
    """A receiver's sessions: which it issued, to which peer, and the last sequence number
    it accepted in each. Shared by the receiving thread only, but locked for readers.

    A peer is the connection a HELLO came on, as the receiving ROUTER socket names it (its
    routing identity), never what a message says: a token holder can write any engine ID
    into a HELLO, but ZeroMQ makes a connection's identity up itself and refuses a second
    connection claiming one in use, so nobody takes another peer's slot. HELLOs sent again
    and again on one connection evict only that connection's own oldest sessions; a flood
    of new connections is bounded by `max_peers` (the least recently active peer goes)."""

    def __init__(self, max_sessions_per_peer: int = MAX_SESSIONS_PER_PEER, max_peers: int = MAX_PEERS):
        if max_sessions_per_peer < 1 or max_peers < 1:
            raise ValueError("a ReplayGuard keeps at least one peer and one session per peer")
        self.max_sessions_per_peer = max_sessions_per_peer
        self.max_peers = max_peers
        self._lock = threading.Lock()
        # per peer, least recently active first: its sessions (least recently used first)
        # and the last sequence number accepted in each
        self._peers: OrderedDict[bytes, OrderedDict[bytes, int]] = OrderedDict()
        self._owner: dict[bytes, bytes] = {}  # session -> the peer it was issued to
        self.refused = 0

    def issue(self, peer: bytes) -> bytes:
        """A new session for `peer` (the connection's routing identity)."""
        session = secrets.token_bytes(SESSION_BYTES)
        with self._lock:
            sessions = self._peers.get(peer)
            if sessions is None:
                sessions = self._peers[peer] = OrderedDict()
                while len(self._peers) > self.max_peers:
                    _, forgotten = self._peers.popitem(last=False)
                    self._forget(forgotten)
            self._peers.move_to_end(peer)
            sessions[session] = 0
            self._owner[session] = peer
            while len(sessions) > self.max_sessions_per_peer:
                oldest, _ = sessions.popitem(last=False)
                del self._owner[oldest]
        return session

    def _forget(self, sessions: OrderedDict[bytes, int]) -> None:
        for session in sessions:
            del self._owner[session]

    def num_sessions(self, peer: bytes | None = None) -> int:
        """Sessions remembered: of `peer`, or in all."""
        with self._lock:
            if peer is None:
                return len(self._owner)
            return len(self._peers.get(peer, ()))

    def admit(self, message_stamp: bytes) -> bool:
        """Whether a message with this stamp is new: of an issued session, and later than
        every message of that session accepted before. A session is not bound to the
        connection it was issued on: ZeroMQ reconnects a sender's socket by itself, under a
        new identity, and the session goes on."""
        if len(message_stamp) != STAMP_BYTES:
            return self._refuse()
        session = message_stamp[:SESSION_BYTES]
        sequence = int.from_bytes(message_stamp[SESSION_BYTES:], "big")
        with self._lock:
            peer = self._owner.get(session)
            sessions = self._peers[peer] if peer is not None else None
            if sessions is None or sequence <= sessions[session]:
                self.refused += 1
                return False
            sessions[session] = sequence
            sessions.move_to_end(session)
            self._peers.move_to_end(peer)
        return True

    def _refuse(self) -> bool:
        with self._lock:
            self.refused += 1
        return False
