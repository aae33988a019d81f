"""One dead part loses nothing, against real processes: `up` with spare capacity (2 render
replicas, 1 prefill, 2 decode workers). SIGKILL, while streams run, the decode worker
serving them (the streams migrate), a render replica (derender calls retry on the other)
and the prefill worker (decode keeps the streams; new prompts fall back to decode). Every
stream completes, equal to the undisturbed greedy output; `up` starts each dead part again
and keeps serving."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import httpx

from tests.conftest import free_port, running_server
from tests.router.test_pd_proxy import metric, up_log
from tests.service.test_drain import Stream

STREAMS = 2


def streams_survive(base: str, expected: str, kill: Callable[[], str]) -> str:
    """Run streams, call `kill` once each has some output; the name of the part killed."""
    streams = [Stream(base) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    while not all(len(stream.pieces) > 5 for stream in streams):
        time.sleep(0.02)
    victim = kill()
    for stream in streams:
        stream.join()
    for stream in streams:
        assert stream.error is None
        assert stream.finish_reason == "length"
        assert "".join(stream.pieces) == expected
    return victim


def test_sigkill_of_any_part_mid_stream_loses_nothing(tiny_model):
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--decode", "2", "--render", "2", "--num-blocks", "512"]
    token = {"SPLITSERVE_INTERNAL_TOKEN": "migration-test-token"}  # to ask a decode part for its stats
    auth = {"Authorization": "Bearer migration-test-token"}
    with running_server([*args, "--min-prefill-tokens", "2"], port, timeout=180, env=token) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        found = re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid (\d+)\)", up_log(port), re.M)
        parts = {name: (url, int(pid)) for name, url, pid in found}
        reference = Stream(base)
        reference.run()
        assert reference.finish_reason == "length", reference.error
        expected = "".join(reference.pieces)

        def kill_busy_decode() -> str:
            for name, (url, pid) in parts.items():
                if not name.startswith("decode"):
                    continue
                stats = httpx.get(f"{url}/inference/v1/stats", headers=auth, timeout=10).json()
                if stats["num_running"] + stats["num_waiting"] > 0:
                    os.kill(pid, signal.SIGKILL)
                    return name
            raise AssertionError("no decode worker is running the streams")

        def kill(name: str) -> Callable[[], str]:
            def killer() -> str:
                os.kill(parts[name][1], signal.SIGKILL)
                return name

            return killer

        victims = [
            streams_survive(base, expected, kill_busy_decode),
            streams_survive(base, expected, kill("render-0")),
            streams_survive(base, expected, kill("prefill-0")),
        ]
        assert metric(httpx.get(f"{base}/metrics").text, "splitserve_proxy_retries_total") >= 1

        # up starts each dead part again; the stack still serves
        deadline = time.monotonic() + 120
        while not all(f"{victim} started again" in up_log(port) for victim in victims):
            assert time.monotonic() < deadline, up_log(port)[-3000:]
            time.sleep(0.2)
        again = Stream(base)
        again.run()
        assert "".join(again.pieces) == expected
