"""What both sides of the P/D connector track between the engine thread and the transport's
threads: loads in flight, which of them the engine has yet to hear about (loaded, failed),
and finished requests whose blocks wait for a reader or writer to let go of them.

One lock guards it all, because a finish and an arrival (or a lend ending) race: the
engine thread finishes a request while a transport thread reports its last layer, and
exactly one of them must be the one that makes the blocks freeable.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from splitserve.kv.connector.handoff_metrics import HandoffMetrics
from splitserve.kv.connector.pd_loads import Load, wall_to_monotonic
from splitserve.kv.transport.arrivals import TransferResult


class Arrival(NamedTuple):
    """A transfer ended: whose, its load, and what the request does about a failure
    (None: it succeeded or nobody waits for it any more; "recompute"; "fail")."""

    request_id: str
    load: Load
    fallback: str | None


class LoadTable:
    def __init__(self, metrics: HandoffMetrics) -> None:
        self.metrics = metrics
        self.lock = threading.Lock()
        self.loads: dict[str, Load] = {}
        self.request_of_transfer: dict[str, str] = {}
        self.loaded: set[str] = set()
        self.failed: set[str] = set()
        self.freeable: set[str] = set()
        self.lent: set[str] = set()  # decode: requests whose prefix blocks are on loan
        self.finish_waits: dict[str, int] = {}  # finished requests: what still reads/writes their blocks

    def start(self, request_id: str, load: Load) -> None:
        with self.lock:
            self.loads[request_id] = load
            self.request_of_transfer[load.transfer_id] = request_id

    def in_flight_transfer(self, request_id: str) -> str | None:
        """The transfer a request still waits for, if any."""
        with self.lock:
            load = self.loads.get(request_id)
            return load.transfer_id if load is not None and not load.done else None

    def arrived(self, result: TransferResult, may_fail_request: bool) -> Arrival | None:
        """Transport thread: the last layer arrived, or the transfer failed. A prefix pull
        never fails its request: failing it only means computing those blocks."""
        now = time.monotonic()
        with self.lock:
            request_id = self.request_of_transfer.pop(result.transfer_id, None)
            load = self.loads.get(request_id) if request_id else None
            if load is None or request_id is None:
                return None
            fail_request = may_fail_request and load.mode != "prefix"
            load.done, load.ok, load.error = True, result.ok, result.error
            load.num_bytes, load.state_bytes = result.num_bytes, result.state_bytes
            load.last_arrival_mono = wall_to_monotonic(result.last_arrival) if result.last_arrival else now
            load.transfer_s = load.last_arrival_mono - load.started
            if result.sender_ready_at is not None and load.mode == "push":
                load.ready_mono = wall_to_monotonic(result.sender_ready_at)
            if load.orphaned:
                self.loads.pop(request_id, None)
                self.finish_one(request_id)
            elif result.ok:
                self.loaded.add(request_id)
            elif not fail_request:
                self.failed.add(request_id)
        fallback = None if result.ok or load.orphaned else "fail" if fail_request else "recompute"
        return Arrival(request_id, load, fallback)

    def finish_one(self, request_id: str) -> None:
        """Under the lock: one reader or writer of a finished request's blocks is done."""
        left = self.finish_waits.get(request_id, 1) - 1
        if left > 0:
            self.finish_waits[request_id] = left
        else:
            self.finish_waits.pop(request_id, None)
            self.freeable.add(request_id)

    def wait_before_free(self, request_id: str) -> None:
        """Under the lock: one more reader or writer must let go of a finished request's blocks."""
        self.finish_waits[request_id] = self.finish_waits.get(request_id, 0) + 1

    def end(self, request_id: str) -> tuple[Load | None, bool]:
        """The request finished: its load, and whether bytes may still land in its blocks
        (then it is orphaned, and its blocks wait until the transport is done with them)."""
        with self.lock:
            load = self.loads.get(request_id)
            if load is not None and not load.done:
                load.orphaned = True
                self.wait_before_free(request_id)
                return load, True
            self.loads.pop(request_id, None)
            return load, False

    def mark_freeable(self, request_id: str) -> None:
        with self.lock:
            self.freeable.add(request_id)

    def lend_started(self, request_id: str) -> None:
        with self.lock:
            self.lent.add(request_id)

    def lend_ended(self, request_id: str) -> None:
        with self.lock:
            self.lent.discard(request_id)
            if request_id in self.finish_waits:
                self.finish_one(request_id)

    def wait_for_lend(self, request_id: str) -> bool:
        """A finished request: whether a prefill worker may still read its prefix (then its
        blocks wait for the lend to end)."""
        with self.lock:
            lent = request_id in self.lent
            if lent:
                self.wait_before_free(request_id)
            return lent

    def take_loaded(self) -> set[str]:
        now = time.monotonic()
        with self.lock:
            loaded, self.loaded = self.loaded, set()
            for request_id in loaded:
                load = self.loads.get(request_id)
                if load is not None and load.last_arrival_mono is not None:
                    load.noticed_mono = now
                    self.metrics.notification_delay.observe(max(0.0, now - load.last_arrival_mono))
        return loaded

    def take_failed(self) -> set[str]:
        with self.lock:
            failed, self.failed = self.failed, set()
        return failed

    def take_freeable(self) -> set[str]:
        with self.lock:
            freeable, self.freeable = self.freeable, set()
        return freeable
