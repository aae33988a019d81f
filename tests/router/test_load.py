"""The router's view of each worker's load: the worker's last report corrected by what
the router sent and saw end since (router/load.py), and the cache-aware pick over it."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_events import BlockStored, KVEventBatch
from splitserve.router.kv_index import KVBlockIndex, KVRoutingWeights
from splitserve.router.load import REPORT_LAG_S, LoadTracker, WorkerLoad
from splitserve.router.routing import Router, RoutingPolicy
from splitserve.router.workers import WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_reports_the_load_is_what_the_router_sent():
    tracker = LoadTracker(clock=Clock())
    assert tracker.load("w") == WorkerLoad(0, 0)
    with tracker.tracking("w", 300, 20) as sent:
        assert tracker.load("w") == WorkerLoad(300, 20)
        sent.prefilled()
        assert tracker.load("w") == WorkerLoad(0, 20)
    assert tracker.load("w") == WorkerLoad(0, 0)
    assert tracker.snapshot("w") == {
        "queued_prefill_tokens": 0,
        "running_decode_blocks": 0,
        "load_reported": False,
    }


def test_a_forgotten_worker_keeps_only_what_is_still_running_there():
    """A worker that left the pool (and may come back under its URL) loses its report;
    requests the router still has running there count until they end."""
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    with tracker.tracking("w", 40, 3):
        clock.now += 1
        tracker.report("w", WorkerLoad(900, 50), polled_at=clock.now)
        assert tracker.load("w") == WorkerLoad(900, 50)
        tracker.forget("w")
        assert tracker.load("w") == WorkerLoad(40, 3)
        assert tracker.snapshot("w")["load_reported"] is False
    assert tracker.load("w") == WorkerLoad(0, 0)


def test_a_report_replaces_the_requests_it_shows_and_is_corrected_for_what_ended_since():
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    with contextlib.ExitStack() as requests:
        first = requests.enter_context(tracker.tracking("w", 100, 7))
        requests.enter_context(tracker.tracking("w", 50, 4))
        clock.now += REPORT_LAG_S
        # polled after both were sent: the report shows them (plus another client's 400)
        tracker.report("w", WorkerLoad(550, 0), polled_at=clock.now)
        assert tracker.load("w") == WorkerLoad(550, 0)
        third = requests.enter_context(tracker.tracking("w", 30, 2))  # after the poll
        assert tracker.load("w") == WorkerLoad(580, 2)
        clock.now += 1
        first.prefilled()  # since the poll: its tokens are computed, its blocks decoding
        assert tracker.load("w") == WorkerLoad(480, 9)
        third.prefilled()
        assert tracker.load("w") == WorkerLoad(450, 9)
    # all three ended: the report's part of them is gone too, another client's stays
    assert tracker.load("w") == WorkerLoad(400, 0)
    tracker.report("w", WorkerLoad(10, 3), polled_at=clock.now)
    assert tracker.snapshot("w") == {
        "queued_prefill_tokens": 10,
        "running_decode_blocks": 3,
        "load_reported": True,
    }
    tracker.report("w", None, polled_at=clock.now)  # a failed poll: the router's count alone
    assert tracker.load("w") == WorkerLoad(0, 0)


def test_a_request_that_ends_while_a_poll_is_under_way_is_not_counted_by_that_report():
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    tracker.report("w", WorkerLoad(0, 0), polled_at=clock.now)
    with tracker.tracking("w", 100, 7):
        clock.now += 1
        polled_at = clock.now  # a poll begins: its answer will show the request queued
        clock.now += 0.01
    tracker.report("w", WorkerLoad(100, 0), polled_at=polled_at)  # it lands after the end
    assert tracker.load("w") == WorkerLoad(0, 0)
    tracker.report("w", WorkerLoad(0, 0), polled_at=clock.now)
    assert tracker.load("w") == WorkerLoad(0, 0)


def test_a_burst_spreads_before_any_report_and_a_long_queue_outweighs_a_cached_prefix():
    pool = WorkerPool([], ["http://a", "http://b"])
    index = KVBlockIndex()
    hashes = [bytes([i]) * 32 for i in range(20)]
    index.apply("http://a", KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, [], 16, None)]))
    router = Router(RoutingPolicy.CACHE_AWARE, index, KVRoutingWeights())
    body = GenerateRequest(
        "r", (1,), block_hashes=(*(h.hex() for h in hashes), "ff" * 32)
    )  # 21 blocks, 20 on a
    with contextlib.ExitStack() as requests:
        picks = []
        for _ in range(4):  # each counts 21 uncached blocks of prefill where it went
            worker = router.pick(pool, "decode", GenerateRequest("r", (1,), block_hashes=("ee" * 32,) * 21))
            picks.append(worker.url)
            requests.enter_context(router.loads.tracking(worker.url, 21 * 16, 21))
        assert sorted(picks) == ["http://a", "http://a", "http://b", "http://b"]
    assert router.pick(pool, "decode", body).url == "http://a"  # idle: the cache wins
    router.loads.report("http://a", WorkerLoad(9 * 16, 0), polled_at=0.0)  # a modest queue
    assert router.pick(pool, "decode", body).url == "http://a"
    router.loads.report("http://a", WorkerLoad(100 * 16, 0), polled_at=0.0)  # a long one
    assert router.pick(pool, "decode", body).url == "http://b"


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--load-interval", "0", "--load-interval"),
        ("--kv-prefill-load-weight", "-1", "prefill_load_weight"),
        ("--kv-decode-load-weight", "nan", "decode_load_weight"),
    ],
)
def test_a_bad_load_setting_is_refused_at_start(flag: str, value: str, named: str):
    args = ["proxy", "--render", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", flag, value]
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert named in proc.stderr
