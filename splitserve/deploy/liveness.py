"""`up`'s liveness check: a part that is alive but no longer answers (SIGSTOPped, wedged)
holds its port and its streams forever, and the supervisor, which restarts only parts
that exited, would never replace it. So `up` probes every part's /health; a part that
answered once since it started and then answers nothing for `timeout_s` is killed
(SIGKILL), and the supervisor starts it again like any dead part. Any HTTP answer counts
as alive (a draining part answers 503); a part still starting (never answered) is left
to its start-up timeout. An FFN daemon (`--afd`) has no HTTP: it is probed with PING on
its ZeroMQ port, answered by its main loop between layers, and given at most
FFN_TIMEOUT_S, since every attention engine's step waits on it while it is silent (its
attention engines meanwhile wait for a daemon at its port, and send their layers again).
The proxy meanwhile keeps the streams of a stalled decode worker
(it moves them, or waits for a decode worker to come back: `--resume-wait`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import httpx
import zmq

from splitserve.deploy.supervisor import Part
from splitserve.protocol.afd import PING, PONG

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
FFN_TIMEOUT_S = 5.0  # a layer takes milliseconds: a daemon silent this long is stuck


class LivenessWatch:
    """Probes the parts `parts()` returns, on its own thread, and kills the unresponsive."""

    def __init__(self, parts: Callable[[], list[Part]], timeout_s: float) -> None:
        self.parts = parts
        self.timeout_s = timeout_s
        self._last_answer: dict[int, float] = {}  # by pid: when it last answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="up-liveness", daemon=True)

    def start(self) -> None:
        if self.timeout_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=PROBE_TIMEOUT_S + 1)

    def _run(self) -> None:
        context = zmq.Context()
        try:
            with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
                while not self._stop.wait(PROBE_INTERVAL_S):
                    for part in list(self.parts()):
                        self._check(client, context, part)
        finally:
            context.term()

    def _check(self, client: httpx.Client, context: zmq.Context, part: Part) -> None:
        pid = part.process.pid
        if part.process.poll() is not None:
            self._last_answer.pop(pid, None)
            return
        ffn = part.url.startswith("tcp://")
        if ffn_answers(context, part.url) if ffn else http_answers(client, part):
            self._last_answer[pid] = time.monotonic()
            return
        last = self._last_answer.get(pid)
        timeout_s = min(self.timeout_s, FFN_TIMEOUT_S) if ffn else self.timeout_s
        if last is None or time.monotonic() - last < timeout_s or self._stop.is_set():
            return
        print(
            f"splitserve up: {part.name} (pid {pid}) has not answered {'PING' if ffn else '/health'} for "
            f"{time.monotonic() - last:.0f}s; killing it to start it again",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._last_answer.pop(pid, None)


def http_answers(client: httpx.Client, part: Part) -> bool:
    headers = {"Authorization": f"Bearer {part.credential}"} if part.credential else {}
    try:
        client.get(f"{part.url}/health", headers=headers)
    except httpx.HTTPError:
        return False
    return True


def ffn_answers(context: zmq.Context, url: str) -> bool:
    """Whether the FFN daemon at `tcp://HOST:PORT` answers PING in PROBE_TIMEOUT_S."""
    with context.socket(zmq.DEALER) as probe:
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(url)
        probe.send(PING)
        return bool(probe.poll(int(PROBE_TIMEOUT_S * 1000))) and probe.recv_multipart() == [PONG]
