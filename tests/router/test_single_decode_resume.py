"""With a single decode worker, a stream outlives its worker: `up --decode 1` (no prefill
pool) restarts a decode worker that died (SIGKILL) or stopped answering (SIGSTOP: `up`'s
liveness check kills it), and the proxy, with no other decode worker to move the stream
to, waits for the new one to come into rotation and resumes the stream there. The client
sees one stream, equal to the undisturbed greedy run."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port, running_server
from tests.router.test_migration import GREEDY, Stream
from tests.router.test_pd_proxy import metric, up_log

BODY = {**GREEDY, "max_tokens": 1500, "return_token_ids": True}


class Single:
    def __init__(self, base: str, port: int, expected: list[int]) -> None:
        self.base, self.port, self.expected = base, port, expected

    def decode_pid(self) -> int:
        log = up_log(self.port)
        started = re.findall(r"^\s+decode-0\s+http://\S+\s+\(pid (\d+)\)", log, re.M)
        return int([*started, *re.findall(r"decode-0 started again \(pid (\d+)\)", log)][-1])

    def restarts(self) -> int:
        return up_log(self.port).count("decode-0 started again")


@pytest.fixture(scope="module")
def single(tiny_model) -> Iterator[Single]:
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--prefill", "0", "--decode", "1", "--num-blocks", "256"]
    args += ["--stall-timeout", "1", "--liveness-timeout", "6", "--resume-wait", "120"]
    with running_server(args, port, timeout=180) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        reference = Stream(base, BODY)
        reference.run()
        assert reference.finish_reason == "length", reference.error
        yield Single(base, port, reference.token_ids)


def survives(single: Single, signum: int) -> None:
    restarts = single.restarts()
    stream = Stream(single.base, BODY)
    stream.start()
    while not stream.pieces and stream.is_alive():
        time.sleep(0.01)
    os.kill(single.decode_pid(), signum)
    stream.join()
    assert stream.error is None and stream.finish_reason == "length"
    assert stream.token_ids == single.expected
    assert single.restarts() == restarts + 1
    assert metric(httpx.get(f"{single.base}/metrics").text, "splitserve_proxy_resume_waits_total") >= 1


def test_a_stream_whose_only_decode_worker_dies_resumes_on_the_restarted_one(single: Single):
    survives(single, signal.SIGKILL)


def test_a_stream_whose_only_decode_worker_stops_resumes_on_the_restarted_one(single: Single):
    """SIGSTOP: alive, silent. The proxy finds the stall and waits; `up` kills the worker
    once its /health has been unanswered for --liveness-timeout and starts it again."""
    survives(single, signal.SIGSTOP)
    assert "has not answered /health" in up_log(single.port)
