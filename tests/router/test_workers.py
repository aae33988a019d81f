"""Worker pools and the P/D policy: least-loaded picks, rotation, health."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import WorkerPool, check_all, health_loop
from tests.conftest import free_port, running_server


def test_pick_is_least_loaded_and_rotates_between_equals():
    pool = WorkerPool(["http://p0", "http://p1"], ["http://d0", "http://d1", "http://d2"])
    first = pool.pick("decode")
    with pool.lease(first):
        second = pool.pick("decode")
        assert second is not None and second.url != first.url
        with pool.lease(second):
            third = pool.pick("decode")
            assert third is not None and third.url not in {first.url, second.url}
            with pool.lease(third):
                assert pool.pick("decode").url == first.url  # all busy: the least loaded
    with pool.lease(pool.pick("decode")):
        pass
    counts = sorted(w["served"] for w in pool.snapshot() if w["role"] == "decode")
    assert counts == [1, 1, 2]
    assert pool.pick("prefill").url in {"http://p0", "http://p1"}


def test_failed_workers_leave_rotation_and_exclusions_apply():
    pool = WorkerPool([], ["http://d0", "http://d1"])
    d0 = next(w for w in pool.workers("decode") if w.url == "http://d0")
    pool.report_failure(d0, "connection refused")
    assert pool.pick("decode").url == "http://d1"
    assert pool.pick("decode", exclude={"http://d1"}) is None
    assert pool.pick("prefill") is None
    pool.set_health(d0, True)
    assert pool.pick("decode", exclude={"http://d1"}).url == "http://d0"
    assert d0.failures == 1


def test_a_pool_needs_a_decode_worker():
    with pytest.raises(ValueError):
        WorkerPool(["http://p0"], [])


def test_health_checks_take_workers_out_and_bring_them_back():
    pool = WorkerPool(["http://p0"], ["http://d0", "http://d1"])
    down = {"http://d0", "http://p0"}

    async def check(worker) -> bool:
        if worker.url == "http://d1":
            raise OSError("unreachable")  # an exception counts as unhealthy
        return worker.url not in down

    async def run() -> None:
        await check_all(pool, check)
        assert [w.healthy for w in pool.workers()] == [False, False, False]
        down.clear()
        task = asyncio.ensure_future(health_loop(pool, check, 0.01))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert pool.pick("prefill").url == "http://p0"
    assert pool.pick("decode").url == "http://d0"


def test_short_prompts_skip_the_prefill_pool():
    policy = PDPolicy(min_prefill_tokens=64)
    assert not policy.use_prefill_pool(63)
    assert policy.use_prefill_pool(64)
    assert not policy.use_prefill_pool(100, num_cached_tokens=40)
    assert PDPolicy(min_prefill_tokens=0).use_prefill_pool(1)
    with pytest.raises(ValueError):
        PDPolicy(mode="sideways")
    with pytest.raises(ValueError):
        PDPolicy(min_prefill_tokens=-1)


def test_workers_join_and_leave_a_pool_that_starts_empty():
    pool = WorkerPool([], [], allow_no_decode=True)
    assert pool.pick("decode") is None
    joined = pool.add("http://d0/", "decode")
    assert pool.add("http://d0", "decode") is joined  # registering again changes nothing
    pool.add("http://p0", "prefill")
    assert pool.pick("decode").url == "http://d0" and pool.pick("prefill").url == "http://p0"
    with pool.lease(joined):
        assert pool.remove("http://d0") and not pool.remove("http://d0")
    assert pool.pick("decode") is None and [w.url for w in pool.workers()] == ["http://p0"]
    with pytest.raises(ValueError):
        WorkerPool([], [])


def test_the_model_list_waits_for_a_decode_worker(tiny_model):
    """An entry point is ready when it says it is: while no decode worker answers, the
    proxy's /v1/models is a 503 `no_worker` (as /health), not a model list that a client
    would take as the go-ahead to send."""
    render_port, proxy_port, dead = free_port(), free_port(), free_port()
    with (
        running_server(["render", tiny_model, "--port", str(render_port)], render_port) as render,
        running_server(
            ["proxy", "--render", render, "--port", str(proxy_port), "--decode", f"http://127.0.0.1:{dead}"],
            proxy_port,
            health_path="/workers",
        ) as proxy,
    ):
        models = httpx.get(f"{proxy}/v1/models", timeout=10)
        assert models.status_code == 503, models.text
        assert models.json()["error"]["code"] == "no_worker" and models.headers["retry-after"] == "1"
        assert httpx.get(f"{proxy}/health", timeout=10).status_code == 503
