"""Helpers shared by the `splitserve sim` commands: output (table or JSON), progress bar,
argument checks, the workload the arguments describe, seed-averaged summaries."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from splitserve.sim.deployment import Deployment
from splitserve.sim.metrics import WorkloadFactory
from splitserve.sim.roofline import Efficiency
from splitserve.sim.simulator import simulate
from splitserve.sim.workload import (
    Workload,
    WorkloadError,
    load_lengths,
    load_trace,
    observed,
    sessions,
    synthetic,
)

# The realistic preset (per-kernel step times) anchored on the guide's measurements, as the
# seed anchored its one-roofline-per-step model (compute 0.47, bandwidth 0.75, 2 ms/step) on
# the guide's low-load medians. Per kernel, a decode step also pays its own attention, so the
# weights stream at 85% of bandwidth with 1 ms per step (median ITL 22 ms at low load, inside
# the guide's 21-24 ms); cached K and V are read at 30% of bandwidth (paged attention over
# long contexts), the one value that puts the collocated p99 ITL at 2 req/s on the guide's
# 263 ms (a fit to it, not a prediction of it); and a prefill step computes as if it had 64
# more tokens (a 512-token chunk at 89% of a large prompt's efficiency: an assumption until
# `sim calibrate --fit-small-chunk` measures it). `sim calibrate` replaces all of them.
SEED_EFFICIENCY = Efficiency()
REALISTIC_EFFICIENCY = Efficiency(
    compute=0.47, bandwidth=0.85, overhead_s=0.001, small_chunk_tokens=64.0, kv_bandwidth=0.30
)


def clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return clean(obj.item())
    return obj


def emit(args: argparse.Namespace, data: object, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(clean(data), indent=1))
    else:
        print("\n".join(lines))
    return 0


@contextlib.contextmanager
def progress(args: argparse.Namespace, total: int, what: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr, silent under --json."""
    if args.json or total <= 1:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


def efficiency(args: argparse.Namespace) -> Efficiency:
    """The flags' efficiencies; those not given come from the preset (seed without one)."""
    preset = REALISTIC_EFFICIENCY if getattr(args, "preset", "seed") == "realistic" else SEED_EFFICIENCY
    overhead_ms = getattr(args, "overhead_ms", None)
    given = {
        "compute": args.eff_compute,
        "bandwidth": args.eff_bandwidth,
        "overhead_s": None if overhead_ms is None else overhead_ms / 1e3,
        "attention": args.eff_attention,
        "per_seq_overhead_s": args.per_seq_overhead_ms / 1e3,
        "small_chunk_tokens": getattr(args, "small_chunk_tokens", None),
        "kv_bandwidth": getattr(args, "eff_kv_bandwidth", None),
    }
    return replace(preset, **{k: v for k, v in given.items() if v is not None})


def require_positive(**values: float) -> None:
    for name, v in values.items():
        if v is None or not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")


def workload_factory(args: argparse.Namespace) -> WorkloadFactory:
    """(rate, requests, seed) -> the workload the arguments describe."""
    require_positive(requests=args.requests, seeds=args.seeds, burstiness=args.burstiness)
    if args.trace:
        trace = load_trace(args.trace)
        span = float(trace.arrival.max()) or 1.0
        natural = len(trace) / span

        def from_trace(rate: float, n: int, seed: int) -> Workload:
            del n, seed  # a trace is what it is
            return replace(trace, arrival=trace.arrival * (natural / rate))

        return from_trace

    if getattr(args, "lengths", None):
        if args.turns > 1:
            raise ValueError("--lengths draws single requests: not with --turns")
        pairs = load_lengths(args.lengths)

        def from_lengths(rate: float, n: int, seed: int) -> Workload:
            return observed(rate, n, pairs, seed=seed, burstiness=args.burstiness)

        return from_lengths

    if args.turns < 1:
        raise ValueError("--turns must be >= 1")
    if args.turns > 1:
        require_positive(message=args.message)
        if args.think_s < 0:
            raise ValueError("--think-s must be >= 0")

        def chats(rate: float, n: int, seed: int) -> Workload:
            return sessions(
                rate,
                max(1, n // args.turns),
                args.turns,
                int(args.prompt),
                args.message,
                int(args.output),
                args.think_s,
                args.stripped,
                seed=seed,
            )

        try:
            chats(1.0, args.requests, 0)
        except ValueError as exc:
            raise WorkloadError(f"multi-turn needs plain integer --prompt/--output ({exc})") from exc
        return chats

    def make(rate: float, n: int, seed: int) -> Workload:
        return synthetic(rate, n, args.prompt, args.output, seed=seed, burstiness=args.burstiness)

    make(1.0, 1, 0)  # validate the length specs now, not inside a progress bar
    return make


def mean_summary(
    dep: Deployment, make: WorkloadFactory, rate: float, requests: int, seeds: int, tick: Callable[[], None]
) -> dict[str, float]:
    runs = []
    for s in range(seeds):
        runs.append(simulate(dep, make(rate, requests, s), seed=s).summary())
        tick()
    mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    mean["requests"] = int(sum(r["requests"] for r in runs))  # over all seeds
    mean["rejected"] = int(sum(r["rejected"] for r in runs))
    return mean
