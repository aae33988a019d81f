"""Receiver side of KV transfers: count arrivals, signal completion once, time out.

A transfer expects every layer of a list of blocks and, for a hybrid (attention + Mamba)
model, the request's Mamba state as of the prompt's end, whole: one frame of exactly the
size the receiver expects, bound to the prompt's last KV hash (the tokens before the
state). `on_done` runs exactly once: on the last arrival (at once, from the thread that
saw it, not at the engine's next step), or
with an error when nothing arrived within the reservation TTL, when a started transfer
made no progress for `timeout_s`, or when someone fails it explicitly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

logger = logging.getLogger(__name__)


class TransferResult(NamedTuple):
    transfer_id: str
    ok: bool
    error: str | None
    num_bytes: int
    started_at: float  # wall clock (time.time) of the expectation
    first_arrival: float | None
    last_arrival: float | None
    sender_ready_at: float | None  # sender's wall clock when the last layer it sent was computed
    expired: bool  # nothing arrived within the reservation TTL
    state: bytes | None = None  # the Mamba state that arrived (hybrid models), whole
    state_bytes: int = 0  # its size (apart from num_bytes, the KV's)


@dataclass
class _Expectation:
    expected: int  # layers x blocks
    block_ids: frozenset[int]  # the blocks this transfer may write: its grant
    # block -> the hash of the KV it must receive (kv_block_hashes: the prompt's chained
    # hashes, cache_salt included); empty for a transfer not bound to tokens
    block_hashes: dict[int, str]
    on_done: Callable[[TransferResult], None]
    started_at: float
    ttl_deadline: float
    arrived: int = 0
    num_bytes: int = 0
    first_arrival: float | None = None
    last_arrival: float | None = None
    last_progress: float = 0.0
    sender_ready_at: float | None = None
    seen: set[tuple[int, int]] = field(default_factory=set)
    state_bytes: int = 0  # the Mamba state's size; 0: no state travels with this transfer
    state_hash: str = ""  # what the state is bound to: the hash of the tokens before it
    state: bytes | None = None

    def complete(self) -> bool:
        return self.arrived >= self.expected and (self.state_bytes == 0 or self.state is not None)

    def stamp_arrival(self, now_wall: float, now: float, ready_at: float | None) -> None:
        """Something of this transfer landed: the timings the handoff report is made of."""
        self.first_arrival = self.first_arrival or now_wall
        self.last_arrival = now_wall
        self.last_progress = now
        if ready_at is not None:
            self.sender_ready_at = max(self.sender_ready_at or 0.0, ready_at)


class ArrivalTracker:
    def __init__(self, timeout_s: float, default_ttl_s: float):
        self.timeout_s = timeout_s
        self.default_ttl_s = default_ttl_s
        self._lock = threading.Lock()
        self._expectations: dict[str, _Expectation] = {}
        self.state_bytes_received = 0  # hybrid models' Mamba states landed, apart from KV

    def expect(
        self,
        transfer_id: str,
        num_layers: int,
        block_ids: list[int],
        on_done: Callable[[TransferResult], None],
        ttl_s: float | None = None,
        block_hashes: Sequence[str] = (),
        state_bytes: int = 0,
        state_hash: str = "",
    ) -> None:
        """`state_bytes` > 0: the transfer also expects a state of that size bound to
        `state_hash`, and is complete only once it has arrived too."""
        if block_hashes and len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_ids)} blocks")
        if state_bytes < 0 or (state_bytes > 0 and not state_hash):
            raise ValueError("an expected state needs a positive size and the hash it is bound to")
        now = time.monotonic()
        expectation = _Expectation(
            expected=num_layers * len(set(block_ids)),
            block_ids=frozenset(block_ids),
            block_hashes=dict(zip(block_ids, block_hashes, strict=False)),
            on_done=on_done,
            started_at=time.time(),
            ttl_deadline=now + (self.default_ttl_s if ttl_s is None else ttl_s),
            last_progress=now,
            state_bytes=state_bytes,
            state_hash=state_hash,
        )
        with self._lock:
            self._expectations[transfer_id] = expectation
        if expectation.complete():
            self.finish(transfer_id, None)

    def accepts(self, transfer_id: str, block_ids: list[int], block_hashes: Sequence[str] = ()) -> bool:
        """Whether a transfer is expected and may write every one of `block_ids`, with the
        KV of the tokens it is bound to (`block_hashes`, the sender's, one per block): data
        for anything else must not touch the pool (it would land in another request's
        blocks, or give this one KV of other tokens)."""
        with self._lock:
            expectation = self._expectations.get(transfer_id)
            if expectation is None or not expectation.block_ids.issuperset(block_ids):
                return False
            if not expectation.block_hashes:
                return True
            expected = [expectation.block_hashes.get(block) for block in block_ids]
            return list(block_hashes) == expected

    def grant(self, transfer_id: str) -> tuple[list[int], list[str]] | None:
        """The blocks an expected transfer may write, sorted, and the hash each must hold
        (empty when the transfer is not bound to tokens); None when it is not expected."""
        with self._lock:
            expectation = self._expectations.get(transfer_id)
            if expectation is None:
                return None
            blocks = sorted(expectation.block_ids)
            hashes = [expectation.block_hashes[b] for b in blocks] if expectation.block_hashes else []
            return blocks, hashes

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            self._expectations.pop(transfer_id, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._expectations)

    def record(
        self, transfer_id: str, layer: int, block_ids: list[int], num_bytes: int, ready_at: float | None
    ) -> None:
        now_wall, now = time.time(), time.monotonic()
        with self._lock:
            expectation = self._expectations.get(transfer_id)
            if expectation is None:
                return  # cancelled, timed out, or never ours: late data is ignored
            for block_id in block_ids:
                key = (layer, block_id)
                if block_id in expectation.block_ids and key not in expectation.seen:
                    expectation.seen.add(key)
                    expectation.arrived += 1
            expectation.num_bytes += num_bytes
            expectation.stamp_arrival(now_wall, now, ready_at)
            complete = expectation.complete()
        if complete:
            self.finish(transfer_id, None)

    def land_state(
        self, transfer_id: str, state: bytes, state_hash: str, ready_at: float | None
    ) -> str | None:
        """A state frame arrived: None when it landed, else why it was refused. A state of
        the wrong size (not whole) also fails the transfer at once (decode recomputes); one
        not expected, bound to other tokens or arriving twice is only dropped, like a KV
        push outside its grant."""
        refused = self._land_state(transfer_id, state, state_hash, ready_at)
        if refused is not None:
            logger.warning("KV transfer %s: a Mamba state refused: %s", transfer_id, refused)
        return refused

    def _land_state(
        self, transfer_id: str, state: bytes, state_hash: str, ready_at: float | None
    ) -> str | None:
        now_wall, now = time.time(), time.monotonic()
        with self._lock:
            expectation = self._expectations.get(transfer_id)
            if expectation is None or expectation.state_bytes == 0:
                return "no state is expected for this transfer"
            if state_hash != expectation.state_hash:
                return "the state is bound to other tokens"
            if expectation.state is not None:
                return "the state has already arrived"
            short = len(state) != expectation.state_bytes
            if not short:
                self.state_bytes_received += len(state)
                expectation.state = state
                expectation.stamp_arrival(now_wall, now, ready_at)
            complete = expectation.complete()
            wanted = expectation.state_bytes
        if short:
            error = f"the Mamba state arrived with {len(state)} bytes, {wanted} expected: not whole"
            self.finish(transfer_id, error)
            return error
        if complete:
            self.finish(transfer_id, None)
        return None

    def check_deadlines(self) -> None:
        now = time.monotonic()
        expired: list[tuple[str, str, bool]] = []
        with self._lock:
            for transfer_id, expectation in self._expectations.items():
                if expectation.first_arrival is None and now > expectation.ttl_deadline:
                    expired.append((transfer_id, "no KV arrived within the reservation TTL", True))
                elif (
                    expectation.first_arrival is not None and now - expectation.last_progress > self.timeout_s
                ):
                    stalled = f"KV transfer stalled for {self.timeout_s:.1f}s (sender gone?)"
                    expired.append((transfer_id, stalled, False))
        for transfer_id, error, ttl_passed in expired:
            self.finish(transfer_id, error, expired=ttl_passed)

    def finish(self, transfer_id: str, error: str | None, *, expired: bool = False) -> None:
        with self._lock:
            expectation = self._expectations.pop(transfer_id, None)
        if expectation is None:
            return
        result = TransferResult(
            transfer_id=transfer_id,
            ok=error is None,
            error=error,
            num_bytes=expectation.num_bytes,
            started_at=expectation.started_at,
            first_arrival=expectation.first_arrival,
            last_arrival=expectation.last_arrival,
            sender_ready_at=expectation.sender_ready_at,
            expired=expired,
            state=expectation.state if error is None else None,
            state_bytes=len(expectation.state) if expectation.state is not None else 0,
        )
        with contextlib.suppress(Exception):
            expectation.on_done(result)
