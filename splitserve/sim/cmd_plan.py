"""`splitserve sim plan --rate R`: how many of each for this rate. The cheapest layouts that
meet the SLO(s) at R in steady state, best first, each with its headroom and the resource
that gives out first above it; `--json` prints `{"plans": [{"prefill": N, "decode": M,
"collocated": K, "encoder": E, ...}, ...]}`."""

from __future__ import annotations

import argparse
from dataclasses import replace

from splitserve.sim.cmd_common import emit, progress, require_positive, workload_factory
from splitserve.sim.cmd_simulation import base_deployment, slos_from_args
from splitserve.sim.metrics import WorkloadFactory
from splitserve.sim.planner import Plan, plan_for_rate
from splitserve.sim.simulator import simulate
from splitserve.sim.steady import SteadyState


def remote_fraction(p: Plan, rate: float, make: WorkloadFactory, requests: int) -> float | None:
    """P/D: the share of requests the cost decision sends through a prefill worker at this
    rate (one run of the workload; None for a collocated layout)."""
    if p.deployment.mode != "pd":
        return None
    result = simulate(p.deployment, make(rate, requests, 0))
    return float(result.summary().get("remote_fraction", 1.0))


def plan_json(p: Plan, rate: float, remote: float | None = None) -> dict:
    dep, e = p.deployment, p.at_rate
    return {
        **p.counts(),
        "gpus": dep.gpus,
        "tp": dep.tp if dep.mode == "collocated" else {"prefill": dep.tp_prefill, "decode": dep.tp_decode},
        "budget": dep.sched.budget if dep.mode == "collocated" else None,
        "layout": dep.label(),
        "rate": rate,
        "attainment": e.attainment,
        "attainment_ci95": [e.attainment - e.half_width, e.attainment + e.half_width],
        "attainment_per_slo": e.per_slo,
        "simulated_requests": e.requests,
        "goodput": p.goodput,
        "headroom": p.headroom,
        "binding": p.binding,
        "remote_fraction": remote,
    }


def cmd_plan(args: argparse.Namespace) -> int:
    base, make = base_deployment(args), workload_factory(args)
    require_positive(rate=args.rate, max_gpus=args.max_gpus, iters=args.iters)
    if not 0 < args.target <= 1:
        raise ValueError("--target must be in (0, 1]")
    if args.transfer_s is not None:
        base = replace(base, link=replace(base.link, fixed_s=args.transfer_s))
    cfg = SteadyState(half_width=args.half_width, max_requests=args.max_requests)
    slos = [slo for _, slo in slos_from_args(args)]
    prompt = float(make(1.0, 200, 0).prompt.mean())
    with progress(args, 0, "planning") as tick:  # the search's length is not known up front
        plans = plan_for_rate(
            base, args.rate, make, slos, prompt, args.max_gpus, args.tps, args.budgets, args.target, cfg,
            args.iters, tick,
        )  # fmt: skip
    rows = [plan_json(p, args.rate, remote_fraction(p, args.rate, make, args.requests)) for p in plans]
    slo_text = " and ".join(s.label() for s in slos)
    lines = [
        f"{base.model.name} on {base.gpu.name} at {args.rate:g} req/s, {slo_text} for "
        f"{args.target:.0%} of requests (steady state, {args.preset} preset)",
    ]
    if not rows:
        lines.append(f"no layout of up to {args.max_gpus} GPUs meets it")
    else:
        lines.append(
            f"  {'#':>2s} {'layout':34s} {'GPUs':>4s} {'attainment':>15s} {'goodput':>9s} "
            f"{'headroom':>8s} {'via P':>6s}  binds first above it"
        )
        for i, r in enumerate(rows, 1):
            half = r["attainment_ci95"][1] - r["attainment"]
            via = "-" if r["remote_fraction"] is None else f"{r['remote_fraction']:.0%}"
            lines.append(
                f"  {i:2d} {r['layout']:34s} {r['gpus']:4d} {r['attainment']:8.1%} ±{half:5.1%}"
                f" {r['goodput']:7.2f}/s {r['headroom']:+8.0%} {via:>6s}  {r['binding']}"
            )
    emit(args, {"rate": args.rate, "slos": [s.name for s in slos], "plans": rows}, lines)
    return 0 if rows else 1
