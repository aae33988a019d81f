"""Bookkeeping of blocks held for a transfer, on both sides of a P/D handoff.

- `ReservationTable` (decode): blocks a request reserved, after its own prefix-cache match,
  for the KV a prefill worker will push. The proxy waits on it to learn where to push.
  The transport's expectation carries the TTL; this table is what the proxy and the
  metrics see.
- `HoldTable` (prefill, pull mode): blocks of a finished request kept until the decode
  worker has read them, or until the TTL passes.

Both are shared between the engine thread, the transport threads and the HTTP loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Reservation(NamedTuple):
    request_id: str
    block_ids: list[int]  # decode's blocks the sender must fill, in block order
    first_block: int  # index of block_ids[0] in the request's block table
    num_cached_tokens: int  # decode's local prefix-cache hit (never transferred)
    num_tokens: int  # prompt positions with KV after the transfer: [0, num_tokens)
    created_at: float  # time.monotonic()
    # bidirectional: the leading blocks decode holds of this prompt (its prefix-cache hit,
    # matched by chained block hash), lent to the prefill worker under lend_id
    lend_id: str | None = None
    lent_block_ids: tuple[int, ...] = ()
    lent_block_hashes: tuple[str, ...] = ()


class ReservationTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reservations: dict[str, Reservation] = {}
        self._events: dict[str, threading.Event] = {}
        self._callbacks: dict[str, list[Callable[[Reservation], None]]] = {}
        self.total_reserved = 0
        self.total_expired = 0

    def _event(self, request_id: str) -> threading.Event:
        event = self._events.get(request_id)
        if event is None:
            event = self._events[request_id] = threading.Event()
        return event

    def add(self, reservation: Reservation) -> None:
        with self._lock:
            self._reservations[reservation.request_id] = reservation
            self.total_reserved += 1
            self._event(reservation.request_id).set()
            callbacks = self._callbacks.pop(reservation.request_id, [])
        for callback in callbacks:
            callback(reservation)

    def on_reserved(self, request_id: str, callback: Callable[[Reservation], None]) -> None:
        """Call `callback(reservation)` once the request has reserved (now, if it has);
        from whichever thread adds it. For event loops: no thread sits waiting."""
        with self._lock:
            found = self._reservations.get(request_id)
            if found is None:
                self._callbacks.setdefault(request_id, []).append(callback)
        if found is not None:
            callback(found)

    def forget_callbacks(self, request_id: str) -> None:
        with self._lock:
            self._callbacks.pop(request_id, None)

    def get(self, request_id: str) -> Reservation | None:
        with self._lock:
            return self._reservations.get(request_id)

    def wait(self, request_id: str, timeout_s: float) -> Reservation | None:
        """Block until the request has reserved its blocks (or the timeout passes)."""
        with self._lock:
            found = self._reservations.get(request_id)
            if found is not None:
                return found
            event = self._event(request_id)
        event.wait(timeout_s)
        with self._lock:
            found = self._reservations.get(request_id)
            if found is None and not event.is_set():
                self._events.pop(request_id, None)
            return found

    def remove(self, request_id: str, expired: bool = False) -> Reservation | None:
        with self._lock:
            self._events.pop(request_id, None)
            found = self._reservations.pop(request_id, None)
            if found is not None and expired:
                self.total_expired += 1
            return found

    def active(self) -> int:
        with self._lock:
            return len(self._reservations)

    def reserved_blocks(self) -> int:
        with self._lock:
            return sum(len(r.block_ids) for r in self._reservations.values())


HOLD_RELEASES = ("read", "unread", "expired")


class HoldTable:
    """Finished requests' blocks kept for a pull; released by the reader or by the TTL."""

    def __init__(self, ttl_s: float, on_release: Callable[[str, str], None]):
        self.ttl_s = ttl_s
        self._on_release = on_release  # (request_id, how: one of HOLD_RELEASES)
        self._lock = threading.Lock()
        # request -> the blocks it holds, each with the hash of the KV it holds
        self._holds: dict[str, dict[int, str]] = {}
        self._timers: dict[str, threading.Timer] = {}

    def hold(self, request_id: str, block_ids: list[int], block_hashes: Sequence[str]) -> None:
        """Hold `block_ids` for a reader; a block without a hash (past `block_hashes`) is
        never lent."""
        timer = threading.Timer(self.ttl_s, self.release, args=(request_id, "expired"))
        timer.daemon = True
        with self._lock:
            self._holds[request_id] = dict(zip(block_ids, block_hashes, strict=False))
            self._timers[request_id] = timer
        timer.start()

    def is_held(self, request_id: str, block_ids: list[int], block_hashes: Sequence[str]) -> bool:
        """Are `block_ids` among the blocks `request_id` holds, and do they hold KV of
        `block_hashes` (the reader's own prompt, cache_salt included)? A reader names the
        hold, the blocks and its tokens: blocks of any other request, or of other tokens
        or another tenant's salt, are never lent under it."""
        with self._lock:
            held = self._holds.get(request_id)
            if held is None or len(block_hashes) != len(block_ids):
                return False
            return all(
                held.get(block) == wanted for block, wanted in zip(block_ids, block_hashes, strict=True)
            )

    def release(self, request_id: str, how: str = "read") -> bool:
        """End a hold: "read" (its reader is done), "unread" (nobody will read it) or
        "expired" (its TTL passed); False when there is none."""
        if how not in HOLD_RELEASES:
            raise ValueError(f"a hold ends as one of {HOLD_RELEASES}, not {how!r}")
        with self._lock:
            if self._holds.pop(request_id, None) is None:
                return False
            timer = self._timers.pop(request_id, None)
        if timer is not None and how != "expired":
            timer.cancel()
        self._on_release(request_id, how)
        return True

    def active(self) -> int:
        with self._lock:
            return len(self._holds)

    def clear(self) -> None:
        with self._lock:
            timers = list(self._timers.values())
            self._timers.clear()
            self._holds.clear()
        for timer in timers:
            timer.cancel()
