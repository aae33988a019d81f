"""A step log's records (`--step-log FILE`, engine/step_log.py writes them): what the
simulator's tools read back (`sim retime`, benchmarks/bench_sim_predicts_bench.py) without
the engine. The line's fields are engine/step_log.py's module doc."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple


class StepRecord(NamedTuple):
    pid: int
    role: str
    t: float
    step_s: float
    tokens: int
    running: int
    thread_cpu_s: float
    thread_wait_s: float | None = None  # absent from logs written before it was recorded
    # the step's shape and threads (absent from older logs: None)
    decodes: int | None = None
    context: int | None = None
    chunks: tuple[tuple[int, int], ...] = ()
    threads: int | None = None
    borrowed: bool = False


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
                if "chunks" in present:
                    present["chunks"] = tuple((int(n), int(past)) for n, past in present["chunks"])
                records.append(StepRecord(**present))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a step record ({exc})") from None
    return records


class PricedStep(NamedTuple):
    record: StepRecord
    cpu_s: float  # the engine thread's CPU for it


def priced_steps(records: Sequence[StepRecord]) -> list[PricedStep]:
    """The logged steps that carry their shape, each with the engine thread's CPU since
    the same process's previous record (the first record of a process has none)."""
    last: dict[int, float] = {}
    out = []
    for r in records:
        before = last.get(r.pid)
        last[r.pid] = r.thread_cpu_s
        if before is None or r.decodes is None or r.threads is None or r.borrowed:
            continue
        out.append(PricedStep(r, r.thread_cpu_s - before))
    return out
