"""What the Ray deployment tests share: the application's name and key, the deployment's
replicas and registered workers, and `--ray-planner`'s stepped-rate check."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.deploy.test_up_plan import PROFILE as PLANNER_BASE_PROFILE

APP = "splitserve-test"
API_KEY = "sk-ray-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}  # the ingress's OpenAI API wants the key
PLANNER_INTERVAL_S = 3.0

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'splitserve[ray]'")


def app_replicas() -> list[str]:
    """The application's replica actors on the cluster. (Asked of Ray, not of Serve: `up`
    and `down` are other drivers, and Serve's controller may have stopped and started
    since this process last talked to it.)"""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in actors if a["namespace"] == "serve" and f"{APP}#" in a["name"]]


def workers() -> list[dict]:
    from ray import serve

    return serve.get_deployment_handle("ProxyIngress", app_name=APP).workers.remote().result()


def wait_for(condition, timeout_s: float = 90, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def planner_profile(path: Path) -> str:
    """An engine 100x slower than test_up_plan's profile: one decode replica serves about
    2 requests/s of these within 10 s to the first token and 4 s gaps, two about 4."""
    steps = json.loads(json.dumps(PLANNER_BASE_PROFILE))
    sim = steps["sim"]["steps"]
    sim["prefill"] = {key: value * 100 for key, value in sim["prefill"].items()}
    sim["decode"]["base_s"] = [value * 100 for value in sim["decode"]["base_s"]]
    sim["decode"]["s_per_context_token"] *= 100
    steps["handoff_fixed_s"] *= 100
    path.write_text(json.dumps(steps))
    return str(path)


def planner_decisions() -> list[dict]:
    from ray import serve

    return serve.get_deployment_handle("ProxyIngress", app_name=APP).planner_decisions.remote().result()


def send_at(
    base: str, body: dict, rate: float, seconds: float | None = None, until: threading.Event | None = None
) -> None:
    """Requests at `rate` a second for `seconds` (or until `until` is set), each answered (OK)
    before this returns."""
    statuses: list[int] = []

    def one() -> None:
        statuses.append(
            httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120).status_code
        )

    threads: list[threading.Thread] = []
    start = time.monotonic()
    count = round(rate * seconds) if seconds is not None else None
    while (count is None or len(threads) < count) and not (until is not None and until.is_set()):
        # an open loop: arrivals do not wait for answers
        while time.monotonic() < start + len(threads) / rate:
            time.sleep(0.01)
        threads.append(threading.Thread(target=one))
        threads[-1].start()
    for thread in threads:
        thread.join(120)
    assert statuses == [200] * len(threads), statuses


def check_the_planner_follows_a_stepped_rate(base: str) -> None:
    """`--ray-planner` under a low, high, low arrival rate: the decode target up within two
    intervals of the step up, Serve runs a second replica, and both come back down within
    two intervals (plus one: the interval the step falls in) of the step down."""
    body = {"prompt": "the ingress", "max_tokens": 8, "temperature": 0}

    def decode_targets() -> list[int]:
        return [d["targets"]["decode"] for d in planner_decisions()]

    def decode_workers() -> int:
        return sum(1 for m in workers() if m["role"] == "decode")

    send_at(base, body, 0.5, 2 * PLANNER_INTERVAL_S)
    wait_for(lambda: len(decode_targets()) >= 1, what="a first decision")
    assert decode_targets()[-1] == 1 and decode_workers() == 1
    seen = len(decode_targets())
    # The high rate lasts until Serve runs the second replica: were it to stop first, the
    # planner would rightly ask for one again before a slow machine had started it.
    high_rate_ends = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        high_rate = pool.submit(send_at, base, body, 5.0, until=high_rate_ends)
        try:
            wait_for(
                lambda: 2 in decode_targets()[seen:],
                3 * PLANNER_INTERVAL_S,
                "the planner to ask for 2 decode",
            )
            up = planner_decisions()[decode_targets().index(2, seen)]
            # (meeting the SLOs or not: a 3 s window of 5/s arrivals may count more than two replicas serve)
            assert up["rate"] > 2 and up["picked"]["decode"] == 2 and up["prompt_tokens"] > 0, up
            wait_for(lambda: decode_workers() == 2, what="Serve to start the second decode replica")
        finally:
            high_rate_ends.set()
        high_rate.result(180)  # every request of the high rate answered OK
    seen = len(decode_targets())
    send_at(base, body, 0.5, 3 * PLANNER_INTERVAL_S)
    wait_for(lambda: 1 in decode_targets()[seen:], 2 * PLANNER_INTERVAL_S, "the planner to ask for 1 decode")
    wait_for(lambda: decode_workers() == 1, what="Serve to take the second decode replica down")
