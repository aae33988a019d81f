"""`splitserve sim` commands that check the simulator against the seed and the guide:
`beyond` (what the seed's simulator leaves out) and `reproduce` (every seed figure)."""

from __future__ import annotations

import argparse

from splitserve.sim.beyond import beyond_variants
from splitserve.sim.cmd_common import (
    efficiency,
    emit,
    mean_summary,
    progress,
    require_positive,
    workload_factory,
)
from splitserve.sim.deployment import Deployment
from splitserve.sim.specs import load_gpu, load_model

# The guide's measurements the seed quotes (Qwen2.5-7B, two L40S, 8k prompts, 256 outputs).
GUIDE = {
    "collocated_p99_itl_0.4": 0.169,
    "collocated_p99_itl_2.0": 0.263,
    "collocated_ttft_median": 0.7,
    "itl_median_lo": 0.021,
    "itl_median_hi": 0.024,
    "pd_ttft_median_1.3": 2.2,
}


def cmd_beyond(args: argparse.Namespace) -> int:
    model, gpu, make = load_model(args.model), load_gpu(args.gpu), workload_factory(args)
    variants = beyond_variants(Deployment(model, gpu, eff=efficiency(args)))
    rows = []
    with progress(args, len(variants) * len(args.rates) * args.seeds, "variants") as tick:
        for name, dep in variants:
            for rate in args.rates:
                rows.append(
                    {
                        "variant": name,
                        "rate": rate,
                        **mean_summary(dep, make, rate, args.requests, args.seeds, tick),
                    }
                )
    lines = [
        f"collocated p99 ITL (ms) per offered load; the guide measured "
        f"{GUIDE['collocated_p99_itl_0.4'] * 1e3:.0f} ms at 0.4 and "
        f"{GUIDE['collocated_p99_itl_2.0'] * 1e3:.0f} ms at 2.0 req/s",
        f"  {'variant':36s}" + "".join(f"{r:>8g}" for r in args.rates),
    ]
    for name, _ in variants:
        vals = [r["itl_p99_s"] for r in rows if r["variant"] == name]
        lines.append(f"  {name:36s}" + "".join(f"{v * 1e3:8.0f}" for v in vals))
    data = {"rows": rows, "guide": GUIDE}
    return emit(args, data, lines)


def _seed_tables(args: argparse.Namespace) -> int:
    """Every cell of the seed's serving, goodput and chunk-sweep tables, from its own arrivals."""
    from splitserve.sim import seed_tables

    with progress(args, seed_tables.RUNS, "the seed's tables") as tick:
        cells = seed_tables.all_cells(tick)
    lines, table = [], None
    for c in cells:
        if c.table != table:
            table = c.table
            lines += [
                "",
                f"{table}: {'row':22s} {'column':34s} {'seed':>8s} {'splitserve':>10s} {'error':>7s}",
            ]
        err = (c.ours - c.seed) / c.seed if c.seed else c.ours - c.seed
        mark = "" if c.ok else "  OFF"
        lines.append(f"  {c.row:30s} {c.column:34s} {c.seed:>8g} {c.ours:>10.4g} {err:>+7.1%}{mark}")
    failed = [f"{c.table} {c.row} {c.column}" for c in cells if not c.ok]
    lines.append(f"{len(cells) - len(failed)}/{len(cells)} cells within 5% (or half the seed's last digit)")
    rows = [{**c._asdict(), "ok": c.ok} for c in cells]
    emit(args, {"cells": rows, "failed": failed}, lines)
    return 1 if failed else 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from splitserve.sim import reproduce

    require_positive(seeds=args.seeds)
    if args.seed_arrivals:
        return _seed_tables(args)
    with progress(args, 5 * args.seeds + 3 * 7 * args.seeds, "reproducing") as tick:
        figures = (
            reproduce.closed_form() + reproduce.simulated(args.seeds, tick) + reproduce.guide(args.seeds)
        )
    rows = [{**f._asdict(), "error": f.error, "ok": f.ok} for f in figures]
    lines = [f"{'figure':46s} {'seed':>9s} {'splitserve':>11s} {'error':>7s}  ok  command"]
    for f in figures:
        lines.append(
            f"{f.name:46s} {f.seed:>9g} {f.ours:>11.4g} {f.error:>+7.1%}  "
            f"{'yes' if f.ok else 'NO ':3s} {f.command}"
        )
    failed = [f.name for f in figures if not f.ok]
    lines.append(f"{len(figures) - len(failed)}/{len(figures)} within tolerance")
    emit(args, {"figures": rows, "failed": failed}, lines)
    return 1 if failed else 0
