"""`sim afd --sweep-concurrency`: each layout against expert parallelism at a range of total
concurrencies (decode sequences over the whole deployment, as a benchmark client at a fixed
concurrency keeps them), and the concurrencies at which each layout is faster or slower per
chip than the baseline."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from splitserve.sim.afd import AFDModel, Layout, compare

MAX_POINTS = 1000  # a sweep is a table a person reads


class SweepPoint(NamedTuple):
    """One concurrency: the baseline's and each layout's output per chip (None: it did not
    run, `skipped` says why: fewer sequences than attention chips, or more than their KV)."""

    concurrency: int
    baseline_tokens_per_s_per_chip: float | None
    layouts: dict[str, dict]  # label -> tokens_per_s_per_chip, vs_baseline, bound, step_s
    skipped: str | None


def parse_sweep(text: str) -> list[int]:
    """`512:4096:256` -> 512, 768, ..., 4096 (the stop included when the step lands on it)."""
    try:
        start, stop, step = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise ValueError(f"bad sweep {text!r}: give START:STOP:STEP sequences, e.g. 512:4096:256") from exc
    if start < 1 or step < 1 or stop < start:
        raise ValueError(f"bad sweep {text!r}: START >= 1, STOP >= START, STEP >= 1")
    values = list(range(start, stop + 1, step))
    if len(values) > MAX_POINTS:
        raise ValueError(f"bad sweep {text!r}: {len(values):,} points, at most {MAX_POINTS:,}")
    return values


def sweep_concurrency(afd: AFDModel, baseline_chips: int, layouts: list[Layout], values: list[int]) -> dict:
    """compare() at each total concurrency of `values` (afd's run otherwise unchanged), and per
    layout the concurrencies where it gives more output per chip than the baseline (faster),
    less (slower), or could not run."""
    points = []
    for n in values:
        at_n = AFDModel(afd.model, afd.gpu, afd.eff, replace(afd.run, concurrency=n))
        try:
            result = compare(at_n, baseline_chips, layouts)
        except ValueError as exc:  # this concurrency does not fit some layout: say which
            points.append(SweepPoint(n, None, {}, str(exc)))
            continue
        rows = {
            r["layout"]: {k: r[k] for k in ("tokens_per_s_per_chip", "vs_baseline", "bound", "step_s")}
            for r in result["layouts"]
        }
        points.append(SweepPoint(n, result["baseline"]["tokens_per_s_per_chip"], rows, None))
    signs = {}
    for layout in layouts:
        label = layout.label()
        ran = [p for p in points if p.skipped is None]
        signs[label] = {
            "faster": [p.concurrency for p in ran if p.layouts[label]["vs_baseline"] > 0],
            "slower": [p.concurrency for p in ran if p.layouts[label]["vs_baseline"] < 0],
        }
    return {
        "baseline": Layout(baseline_chips, 0).label(),
        "points": [p._asdict() for p in points],
        "signs": signs,
    }


def spans(values: list[int], grid: list[int]) -> str:
    """`values` as runs of consecutive points of `grid`: `512-1,024, 2,048` ("none" if empty)."""
    if not values:
        return "none"
    chosen, runs, run = set(values), [], []
    for v in grid:
        if v in chosen:
            run.append(v)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return ", ".join(f"{r[0]:,}" if len(r) == 1 else f"{r[0]:,}-{r[-1]:,}" for r in runs)
