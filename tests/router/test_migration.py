"""Request migration and supervision against real processes: `up` with two decode
workers; SIGKILL the decode worker serving streams mid-stream. Every stream completes,
each equal to the undisturbed greedy output, and `up` starts the dead part again and keeps
serving."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx

from tests.conftest import free_port, running_server
from tests.router.test_pd_proxy import metric, up_log
from tests.service.test_drain import Stream

STREAMS = 2


def test_sigkill_of_a_decode_worker_mid_stream_loses_nothing(tiny_model):
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--decode", "2", "--num-blocks", "512"]
    with running_server([*args, "--min-prefill-tokens", "2"], port, timeout=180) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        parts = re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid (\d+)\)", up_log(port), re.M)
        decodes = {name: (url, int(pid)) for name, url, pid in parts if name.startswith("decode")}
        reference = Stream(base)
        reference.run()
        assert reference.finish_reason == "length", reference.error

        streams = [Stream(base) for _ in range(STREAMS)]
        for stream in streams:
            stream.start()
        while not all(len(stream.pieces) > 5 for stream in streams):
            time.sleep(0.02)
        busy = [
            (name, pid)
            for name, (url, pid) in decodes.items()
            if httpx.get(f"{url}/inference/v1/stats", timeout=10).json()["num_running"] > 0
        ]
        victim, victim_pid = busy[0]
        os.kill(victim_pid, signal.SIGKILL)
        for stream in streams:
            stream.join()
        for stream in streams:
            assert stream.error is None
            assert stream.finish_reason == "length"
            assert "".join(stream.pieces) == "".join(reference.pieces)
        assert metric(httpx.get(f"{base}/metrics").text, "splitserve_proxy_retries_total") >= 1

        # up starts the dead worker again; the stack still serves
        deadline = time.monotonic() + 120
        while f"{victim} started again" not in up_log(port):
            assert time.monotonic() < deadline, up_log(port)[-3000:]
            time.sleep(0.2)
        again = Stream(base)
        again.run()
        assert "".join(again.pieces) == "".join(reference.pieces)
