"""`splitserve sim` commands that check the simulator against the seed and the guide:
`beyond` (what the seed's simulator leaves out) and `reproduce` (every seed figure)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from splitserve.sim.cmd_common import (
    efficiency,
    emit,
    mean_summary,
    progress,
    require_positive,
    workload_factory,
)
from splitserve.sim.simulator import Deployment
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


def beyond_variants(base: Deployment) -> list[tuple[str, Deployment]]:
    """The seed's simulator, then each thing it leaves out, then all of them together."""
    multi = replace(base.sched, max_prefills_per_step=None)
    return [
        ("seed's model", base),
        ("+ per-kernel step time", replace(base, combine="sum")),
        ("+ several prompts per step", replace(base, sched=multi)),
        ("+ KV memory limit", replace(base, kv_limit=True)),
        ("+ load-unaware routing", replace(base, routing="random")),
        ("all of the above", replace(base, combine="sum", sched=multi, kv_limit=True, routing="random")),
    ]


def cmd_beyond(args: argparse.Namespace) -> int:
    model, gpu, make = load_model(args.model), load_gpu(args.gpu), workload_factory(args)
    variants = beyond_variants(Deployment(model, gpu, eff=efficiency(args)))
    rows = []
    with progress(args, len(variants) * len(args.rates) * args.seeds, "variants") as tick:
        for name, dep in variants:
            for rate in args.rates:
                rows.append(
                    {"variant": name, "rate": rate, **mean_summary(dep, make, rate, args.seeds, tick)}
                )
    lines = [
        f"collocated p99 ITL (ms) per offered load; the guide measured "
        f"{GUIDE['collocated_p99_itl_0.4'] * 1e3:.0f} ms at 0.4 and "
        f"{GUIDE['collocated_p99_itl_2.0'] * 1e3:.0f} ms at 2.0 req/s",
        f"  {'variant':28s}" + "".join(f"{r:>8g}" for r in args.rates),
    ]
    for name, _ in variants:
        vals = [r["itl_p99_s"] for r in rows if r["variant"] == name]
        lines.append(f"  {name:28s}" + "".join(f"{v * 1e3:8.0f}" for v in vals))
    data = {"rows": rows, "guide": GUIDE}
    return emit(args, data, lines)


def cmd_reproduce(args: argparse.Namespace) -> int:
    from splitserve.sim import reproduce

    require_positive(seeds=args.seeds)
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
