"""`--step-log FILE`: one JSON line per engine step, to set what an engine did beside what
the simulator says it does (benchmarks/bench_sim_predicts_bench.py --step-log).

A line: `{"pid", "role", "t", "step_s", "tokens", "running", "thread_cpu_s",
"thread_wait_s", "decodes", "context", "chunks", "threads", "borrowed"}`: the process, its
role, when the step ended (CLOCK_MONOTONIC, the same clock in every process of the host),
how long its model call took, the tokens it computed, the requests running after it, the
engine thread's CPU time so far, the time it has so far waited runnable for a core
(Linux's /proc schedstat; null where the kernel keeps none), and what the step computed as
the simulator prices it (`StepShape`: the sequences decoding one token, their contexts
summed, each prompt chunk's `[tokens, computed before]`), on how many threads, and whether
they included an idle lender's CPUs (`sim retime` re-times a profile from these). Between
two lines of one process, a step's time that is neither the thread's CPU nor its wait for
a core is time it was blocked (the GIL, a lock, I/O): what took a step's time from it is
read, not inferred. Several engines may append to one file
(`up --step-log FILE` gives it to each): the file is opened for appending and each line is
written whole, so lines of different processes do not interleave. protocol/step_record.py
reads them back (its `StepRecord`s), without the engine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from splitserve.runtime.thread_wait import ThreadWait

if TYPE_CHECKING:
    from splitserve.engine.async_engine import AsyncEngine


class StepLog:
    """A step listener (AsyncEngine.add_step_listener) appending one line per step."""

    def __init__(self, path: str | Path, engine: AsyncEngine, role: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (open as long as the process; each line is flushed)
        self._engine = engine
        self._prefix = f'{{"pid": {os.getpid()}, "role": {json.dumps(role)}, '
        self._wait = ThreadWait()  # the engine thread's: on_step runs there

    def on_step(self, step_time_s: float, num_tokens: int) -> None:
        # on the engine thread, right after the step: its snapshot of the batch is current
        stats = self._engine.stats()
        shape = stats.last_step_shape
        wait = self._wait.seconds()
        self._file.write(
            f'{self._prefix}"t": {time.monotonic():.6f}, "step_s": {step_time_s:.6f}, '
            f'"tokens": {num_tokens}, "running": {stats.num_running}, '
            f'"thread_cpu_s": {time.thread_time():.6f}, '
            f'"thread_wait_s": {"null" if wait is None else f"{wait:.6f}"}, '
            f'"decodes": {shape.decodes}, "context": {shape.decode_context}, '
            f'"chunks": {json.dumps([list(c) for c in shape.chunks])}, "threads": {stats.num_threads}, '
            f'"borrowed": {json.dumps(stats.last_step_borrowed)}}}\n'
        )


def attach_step_log(path: str | None, engine: AsyncEngine, role: str) -> StepLog | None:
    """The step log `--step-log` asks for, listening to `engine`; None without the flag.
    OSError when the file cannot be opened for appending."""
    if not path:
        return None
    log = StepLog(path, engine, role)
    engine.add_step_listener(log.on_step)
    return log
