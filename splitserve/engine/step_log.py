"""`--step-log FILE`: one JSON line per engine step, to set what an engine did beside what
the simulator says it does (benchmarks/bench_sim_predicts_bench.py --step-log).

A line: `{"pid", "role", "t", "step_s", "tokens", "running", "thread_cpu_s",
"thread_wait_s"}`: the process, its role, when the step ended (CLOCK_MONOTONIC, the same
clock in every process of the host), how long its model call took, the tokens it
computed, the requests running after it, the engine thread's CPU time so far, and the
time it has so far waited runnable for a core (Linux's /proc schedstat; null where the
kernel keeps none). Between two lines of one process, a step's time that is neither the
thread's CPU nor its wait for a core is time it was blocked (the GIL, a lock, I/O): what
took a step's time from it is read, not inferred. Several engines may append to one file
(`up --step-log FILE` gives it to each): the file is opened for appending and each line is
written whole, so lines of different processes do not interleave.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from splitserve.runtime.thread_wait import ThreadWait

if TYPE_CHECKING:  # reading a log (benchmarks) needs no engine, nor torch
    from splitserve.engine.async_engine import AsyncEngine


class StepRecord(NamedTuple):
    pid: int
    role: str
    t: float
    step_s: float
    tokens: int
    running: int
    thread_cpu_s: float
    thread_wait_s: float | None = None  # absent from logs written before it was recorded


class StepLog:
    """A step listener (AsyncEngine.add_step_listener) appending one line per step."""

    def __init__(self, path: str | Path, engine: AsyncEngine, role: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (open as long as the process; each line is flushed)
        self._engine = engine
        self._prefix = f'{{"pid": {os.getpid()}, "role": {json.dumps(role)}, '
        self._wait = ThreadWait()  # the engine thread's: on_step runs there

    def on_step(self, step_time_s: float, num_tokens: int) -> None:
        # on the engine thread, right after the step: its snapshot of the batch is current
        running = self._engine.stats().num_running
        wait = self._wait.seconds()
        self._file.write(
            f'{self._prefix}"t": {time.monotonic():.6f}, "step_s": {step_time_s:.6f}, '
            f'"tokens": {num_tokens}, "running": {running}, "thread_cpu_s": {time.thread_time():.6f}, '
            f'"thread_wait_s": {"null" if wait is None else f"{wait:.6f}"}}}\n'
        )


def attach_step_log(path: str | None, engine: AsyncEngine, role: str) -> StepLog | None:
    """The step log `--step-log` asks for, listening to `engine`; None without the flag.
    OSError when the file cannot be opened for appending."""
    if not path:
        return None
    log = StepLog(path, engine, role)
    engine.add_step_listener(log.on_step)
    return log


def read_step_log(path: str | Path) -> list[StepRecord]:
    """Every record in a step log, in file order; ValueError naming the line that is not one."""
    records = []
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
                present = {name: fields[name] for name in StepRecord._fields if name in fields}
                records.append(StepRecord(**present))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a step record ({exc})") from None
    return records
