"""`up`'s liveness check: a part that is alive but no longer answers (SIGSTOPped, wedged)
holds its port and its streams forever, and the supervisor, which restarts only parts
that exited, would never replace it. So `up` probes every part's /health; a part that
answered once since it started and then answers nothing for `timeout_s` is killed
(SIGKILL), and the supervisor starts it again like any dead part. Any HTTP answer counts
as alive (a draining part answers 503); a part still starting (never answered) is left
to its start-up timeout. The proxy meanwhile keeps the streams of a stalled decode worker
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

from splitserve.deploy.supervisor import Part

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0


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
        with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
            while not self._stop.wait(PROBE_INTERVAL_S):
                for part in list(self.parts()):
                    self._check(client, part)

    def _check(self, client: httpx.Client, part: Part) -> None:
        pid = part.process.pid
        if not part.url.startswith("http"):
            return  # an FFN daemon has no /health: the supervisor restarts it once it exits
        if part.process.poll() is not None:
            self._last_answer.pop(pid, None)
            return
        headers = {"Authorization": f"Bearer {part.credential}"} if part.credential else {}
        with contextlib.suppress(httpx.HTTPError):
            client.get(f"{part.url}/health", headers=headers)
            self._last_answer[pid] = time.monotonic()
            return
        last = self._last_answer.get(pid)
        if last is None or time.monotonic() - last < self.timeout_s or self._stop.is_set():
            return
        print(
            f"splitserve up: {part.name} (pid {pid}) has not answered /health for "
            f"{time.monotonic() - last:.0f}s; killing it to start it again",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._last_answer.pop(pid, None)
