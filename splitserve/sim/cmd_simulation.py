"""`splitserve sim` commands that run the simulator: simulate, goodput, sweep-chunk, plan."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from splitserve.config import SchedulerConfig, TransferConfig
from splitserve.goodput import SLO, SLO_AVERAGE, SLO_WORST_GAP
from splitserve.protocol.pd_decision import CostModel
from splitserve.sim.cmd_common import (
    clean,
    efficiency,
    emit,
    mean_summary,
    progress,
    require_positive,
    workload_factory,
)
from splitserve.sim.deployment import Deployment, KVLink
from splitserve.sim.engine import InstanceConfig
from splitserve.sim.metrics import goodput
from splitserve.sim.profile import load_profile
from splitserve.sim.simulator import simulate
from splitserve.sim.specs import load_gpu, load_model


def base_deployment(args: argparse.Namespace) -> Deployment:
    """The deployment the arguments describe, under the chosen preset."""
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    link_gbps = args.link_gbps if args.link_gbps is not None else gpu.net_bw * 8 / 1e9
    require_positive(budget=args.budget, link_gbps=link_gbps, replicas=args.replicas, tp=args.tp)
    realistic = args.preset == "realistic"
    per_step = None if realistic else 1  # the seed advances one prompt per step
    sched = InstanceConfig(SchedulerConfig(max_num_batched_tokens=args.budget), prompts_per_step=per_step)
    if args.prefill_budget is not None:
        require_positive(prefill_budget=args.prefill_budget)
    # realistic: a prefill instance chunks with the same budget as any vLLM or splitserve instance
    prefill_budget = args.prefill_budget or (args.budget if realistic else None)
    prefill_sched = InstanceConfig(
        SchedulerConfig(max_num_batched_tokens=prefill_budget or args.budget),
        chunked_prefill=prefill_budget is not None,
        prompts_per_step=per_step,
    )
    return Deployment(
        model,
        gpu,
        replicas=args.replicas,
        tp=args.tp,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        tp_prefill=args.tp_prefill,
        tp_decode=args.tp_decode,
        eff=efficiency(args),
        combine=args.step_time or ("sum" if realistic else "max"),
        sched=sched,
        prefill_sched=prefill_sched,
        routing=args.routing or ("least_loaded" if realistic else "round_robin"),
        transfer=TransferConfig(mode=args.kv_mode),
        link=KVLink(gbps=link_gbps, overhead_s=args.transfer_overhead_ms / 1e3),
        kv_limit=args.kv_limit or realistic,
        bidirectional=args.bidirectional,
        **profile_fields(args),
    )


def profile_fields(args: argparse.Namespace) -> dict:
    """What `--profile` and `--pd-decision` set on a deployment: the measured step model,
    the render tier's cost, and the P/D decision's costs (cost-based by default with a
    profile, the proxy's defaults without one)."""
    profile = load_profile(args.profile) if getattr(args, "profile", None) else None
    decision = getattr(args, "pd_decision", None) or ("cost" if profile else "always")
    fields: dict = {}
    if profile is not None:
        fields.update(steps=profile.steps, cpu=profile.cpu)
    if decision == "cost":
        fields["pd_costs"] = profile.decision_costs() if profile else CostModel()
    return fields


def _designs(args: argparse.Namespace, base: Deployment) -> list[tuple[str, Deployment]]:
    out = []
    for spec in args.design or ["collocated", "pd:1.3", "pd:0.02"]:
        kind, _, value = spec.partition(":")
        if kind == "collocated" and not value:
            out.append(("collocated", replace(base, mode="collocated")))
        elif kind == "pd":
            if value:
                try:
                    fixed = float(value)
                except ValueError as exc:
                    raise ValueError(f"bad design {spec!r}: pd:SECONDS") from exc
                label = f"P/D, {fixed * 1e3:.0f} ms transfer" if fixed < 1 else f"P/D, {fixed:g} s transfer"
                out.append((label, replace(base, mode="pd", link=replace(base.link, fixed_s=fixed))))
            else:
                how = "layer by layer" if base.transfer.mode == "push" else "after prefill"
                out.append((f"P/D, {base.link.gbps:g} Gb/s {how}", replace(base, mode="pd")))
        else:
            raise ValueError(f"unknown design {spec!r}: use collocated, pd or pd:SECONDS")
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:6.0f}ms"


def cmd_simulate(args: argparse.Namespace) -> int:
    base, make = base_deployment(args), workload_factory(args)
    designs = _designs(args, base)
    rows = []
    with progress(args, len(args.rates) * len(designs) * args.seeds, "simulating") as tick:
        for rate in args.rates:
            for name, dep in designs:
                rows.append(
                    {
                        "rate": rate,
                        "design": name,
                        **mean_summary(dep, make, rate, args.requests, args.seeds, tick),
                    }
                )
    lines = [
        f"{'req/s':>5s} | " + " | ".join(f"{name:^27s}" for name, _ in designs),
        f"{'':5s} | " + " | ".join(f"{'TTFT':>7s} {'ITL p50':>8s} {'ITL p99':>8s}  " for _ in designs),
    ]
    for rate in args.rates:
        cells = [
            f"{r['ttft_median_s']:6.2f}s {_ms(r['itl_p50_s'])} {_ms(r['itl_p99_s'])}"
            for r in rows
            if r["rate"] == rate
        ]
        lines.append(f"{rate:5g} | " + " | ".join(cells))
    if args.plot:
        from splitserve.sim import plots

        rate = args.rates[min(1, len(args.rates) - 1)]
        series = {
            name: np.concatenate(
                [simulate(dep, make(rate, args.requests, s), s).itl() for s in range(args.seeds)]
            )
            for name, dep in designs
        }
        plots.itl_cdf(args.plot, series, f"{base.model.name} on {base.gpu.name}: ITL CDF at {rate:g} req/s")
        lines.append(f"wrote {args.plot}")
    if args.records:
        count = _write_records(args.records, designs, make, args.rates, args.requests, args.seeds)
        lines.append(f"wrote {count} request records to {args.records}")
    return emit(args, {"rows": rows, "plot": args.plot, "records": args.records}, lines)


def _write_records(path: str, designs, make, rates: list[float], requests: int, seeds: int) -> int:
    """Per-request records (JSON lines) of every run: TTFT, TPOT, worst gap, every gap."""
    count = 0
    try:
        with open(path, "w") as f:
            for rate in rates:
                for name, dep in designs:
                    for seed in range(seeds):
                        r = simulate(dep, make(rate, requests, seed), seed=seed)
                        for i in range(len(r.ttft)):
                            rec = {
                                "design": name, "rate": rate, "seed": seed, "request": i,
                                "arrival_s": r.arrival[i], "ttft_s": r.ttft[i], "tpot_s": r.tpot[i],
                                "worst_gap_s": r.worst_gap[i], "e2e_s": r.e2e[i],
                                "output_tokens": int(r.output[i]), "itl_s": r.gaps[i].tolist(),
                            }  # fmt: skip
                            f.write(json.dumps(clean(rec)) + "\n")
                            count += 1
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc}") from exc
    return count


def slos_from_args(args: argparse.Namespace) -> list[tuple[str, SLO]]:
    if args.slo == "custom":
        bounds = {
            "ttft": args.ttft,
            "tpot": None if args.tpot_ms is None else args.tpot_ms / 1e3,
            "p99_itl": None if args.p99_itl_ms is None else args.p99_itl_ms / 1e3,
            "gap": None if args.worst_gap_ms is None else args.worst_gap_ms / 1e3,
        }
        if all(v is None for v in bounds.values()):
            raise ValueError(
                "--slo custom needs at least one of --ttft, --tpot-ms, --p99-itl-ms, --worst-gap-ms"
            )
        return [("custom", SLO(**bounds))]
    named = {"average": [("average", SLO_AVERAGE)], "worst-gap": [("worst-gap", SLO_WORST_GAP)]}
    return named.get(args.slo, named["average"] + named["worst-gap"])


def cmd_goodput(args: argparse.Namespace) -> int:
    base, make = base_deployment(args), workload_factory(args)
    designs, slos = _designs(args, base), slos_from_args(args)
    if not 0 < args.target <= 1:
        raise ValueError("--target must be in (0, 1]")
    total = len(slos) * len(designs) * len(args.rates) * args.seeds
    results = []
    with progress(args, total, "goodput search") as tick:
        for slo_name, slo in slos:
            for name, dep in designs:
                gp = goodput(dep, make, slo, args.rates, args.target, args.requests, args.seeds, tick)
                results.append(
                    {
                        "slo": slo_name,
                        "slo_label": slo.label(),
                        "design": name,
                        "goodput": gp.goodput,
                        "attainment": [[p.rate, p.attainment] for p in gp.points],
                    }
                )
    lines = []
    for slo_name, slo in slos:
        lines += [
            f"{slo_name}: {slo.label()}",
            f"  {'':24s}" + "".join(f"{r:>7g}" for r in args.rates) + f"   goodput ({args.target:.0%} met)",
        ]
        for r in (r for r in results if r["slo"] == slo_name):
            lines.append(
                f"  {r['design']:24s}"
                + "".join(f"{a:>7.0%}" for _, a in r["attainment"])
                + f"   {r['goodput']:g} req/s"
            )
        lines.append("")
    if args.plot:
        from splitserve.sim import plots

        panels = {
            f"{n}: {s.label()}": {r["design"]: r["attainment"] for r in results if r["slo"] == n}
            for n, s in slos
        }
        plots.attainment_vs_rate(args.plot, panels, args.target)
        lines.append(f"wrote {args.plot}")
    return emit(args, {"target": args.target, "results": results, "plot": args.plot}, lines)


def cmd_sweep_chunk(args: argparse.Namespace) -> int:
    base, make = base_deployment(args), workload_factory(args)
    rows = []
    with progress(args, len(args.rates) * len(args.budgets) * args.seeds, "sweeping budgets") as tick:
        for rate in args.rates:
            for budget in args.budgets:
                dep = replace(base, mode="collocated", sched=base.sched.with_budget(budget))
                runs = []
                for s in range(args.seeds):
                    runs.append(simulate(dep, make(rate, args.requests, s), seed=s))
                    tick()
                sm = [r.summary() for r in runs]
                rows.append(
                    {
                        "rate": rate,
                        "budget": budget,
                        "ttft_median_s": float(np.mean([x["ttft_median_s"] for x in sm])),
                        "itl_p99_s": float(np.mean([x["itl_p99_s"] for x in sm])),
                        "worst_gap_s": float(np.mean([x["worst_gap_max_s"] for x in sm])),
                    }
                )
    lines = []
    for rate in args.rates:
        lines += [
            f"offered load {rate} req/s",
            f"  {'tokens/step':>11s} {'median TTFT':>12s} {'p99 ITL':>9s} {'worst gap':>10s}",
        ]
        for r in (r for r in rows if r["rate"] == rate):
            lines.append(
                f"  {r['budget']:11,d} {r['ttft_median_s']:10.2f} s {r['itl_p99_s'] * 1e3:7.0f} ms"
                f" {r['worst_gap_s'] * 1e3:8.0f} ms"
            )
    if args.plot:
        from splitserve.sim import plots

        rate = args.rates[0]
        series = {
            f"budget {b}": np.concatenate(
                [
                    simulate(
                        replace(base, mode="collocated", sched=base.sched.with_budget(b)),
                        make(rate, args.requests, s),
                        s,
                    ).itl()
                    for s in range(args.seeds)
                ]
            )
            for b in args.budgets
        }
        plots.itl_cdf(args.plot, series, f"collocated ITL CDF at {rate:g} req/s by chunk budget")
        lines.append(f"wrote {args.plot}")
    return emit(args, {"rows": rows, "plot": args.plot}, lines)
