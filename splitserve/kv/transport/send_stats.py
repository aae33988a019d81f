"""What a transport's send lanes moved for each transfer, and why a job of it failed: kept
until the sender asks (a finished prefill's push report), plus the totals `kv/info` shows."""

from __future__ import annotations

import threading
from typing import NamedTuple


class SentStats(NamedTuple):
    seconds: float  # spent copying the KV out
    kv_bytes: int
    state_bytes: int  # a hybrid model's Mamba state, counted apart from the KV


class SendLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # every lane thread notes, the engine thread takes
        self._stats: dict[str, SentStats] = {}
        self._errors: dict[str, str] = {}
        self.kv_bytes = 0
        self.state_bytes = 0

    def note(self, transfer_id: str, seconds: float, kv_bytes: int, state_bytes: int = 0) -> None:
        with self._lock:
            before = self._stats.get(transfer_id, SentStats(0.0, 0, 0))
            self._stats[transfer_id] = SentStats(
                before.seconds + seconds, before.kv_bytes + kv_bytes, before.state_bytes + state_bytes
            )
            self.kv_bytes += kv_bytes
            self.state_bytes += state_bytes

    def note_error(self, transfer_id: str, error: str) -> None:
        with self._lock:
            self._errors[transfer_id] = error

    def take(self, transfer_id: str) -> SentStats:
        """What was sent for a transfer, forgotten afterwards."""
        with self._lock:
            return self._stats.pop(transfer_id, SentStats(0.0, 0, 0))

    def take_error(self, transfer_id: str) -> str | None:
        with self._lock:
            return self._errors.pop(transfer_id, None)
