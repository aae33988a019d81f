"""`splitserve sim` commands that run the simulator: simulate, goodput, sweep-chunk, plan."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from splitserve.sim.cmd_common import (
    clean,
    efficiency,
    emit,
    mean_summary,
    progress,
    require_positive,
    workload_factory,
)
from splitserve.sim.engine import SchedulerConfig
from splitserve.sim.metrics import SLO, SLO_AVERAGE, SLO_WORST_GAP, goodput
from splitserve.sim.planner import layouts, plan, search_steps
from splitserve.sim.simulator import Deployment, TransferConfig, simulate
from splitserve.sim.specs import load_gpu, load_model


def _base(args: argparse.Namespace) -> Deployment:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    link_gbps = args.link_gbps if args.link_gbps is not None else gpu.net_bw * 8 / 1e9
    require_positive(budget=args.budget, link_gbps=link_gbps, replicas=args.replicas, tp=args.tp)
    realistic = args.preset == "realistic"
    sched = SchedulerConfig(budget=args.budget, max_prefills_per_step=None if realistic else 1)
    if args.prefill_budget is not None:
        require_positive(prefill_budget=args.prefill_budget)
    # realistic: a prefill instance chunks with the same budget as any vLLM instance
    prefill_budget = args.prefill_budget or (args.budget if realistic else None)
    prefill_sched = SchedulerConfig(budget=prefill_budget, max_prefills_per_step=None if realistic else 1)
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
        combine="sum" if realistic else "max",
        sched=sched,
        prefill_sched=prefill_sched,
        routing=args.routing or ("random" if realistic else "round_robin"),
        transfer=TransferConfig(
            link_gbps=link_gbps,
            overhead_s=args.transfer_overhead_ms / 1e3,
            layerwise=args.layerwise,
            notify=args.notify,
        ),
        kv_limit=args.kv_limit or realistic,
        bidirectional=args.bidirectional,
    )


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
                out.append((label, replace(base, mode="pd", transfer=replace(base.transfer, fixed_s=fixed))))
            else:
                how = "layer by layer" if base.transfer.layerwise else "after prefill"
                out.append((f"P/D, {base.transfer.link_gbps:g} Gb/s {how}", replace(base, mode="pd")))
        else:
            raise ValueError(f"unknown design {spec!r}: use collocated, pd or pd:SECONDS")
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:6.0f}ms"


def cmd_simulate(args: argparse.Namespace) -> int:
    base, make = _base(args), workload_factory(args)
    designs = _designs(args, base)
    rows = []
    with progress(args, len(args.rates) * len(designs) * args.seeds, "simulating") as tick:
        for rate in args.rates:
            for name, dep in designs:
                rows.append({"rate": rate, "design": name, **mean_summary(dep, make, rate, args.seeds, tick)})
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
            name: np.concatenate([simulate(dep, make(rate, s), s).itl() for s in range(args.seeds)])
            for name, dep in designs
        }
        plots.itl_cdf(args.plot, series, f"{base.model.name} on {base.gpu.name}: ITL CDF at {rate:g} req/s")
        lines.append(f"wrote {args.plot}")
    if args.records:
        count = _write_records(args.records, designs, make, args.rates, args.seeds)
        lines.append(f"wrote {count} request records to {args.records}")
    return emit(args, {"rows": rows, "plot": args.plot, "records": args.records}, lines)


def _write_records(path: str, designs, make, rates: list[float], seeds: int) -> int:
    """Per-request records (JSON lines) of every run: TTFT, TPOT, worst gap, every gap."""
    count = 0
    try:
        with open(path, "w") as f:
            for rate in rates:
                for name, dep in designs:
                    for seed in range(seeds):
                        r = simulate(dep, make(rate, seed), seed=seed)
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


def _slos(args: argparse.Namespace) -> list[tuple[str, SLO]]:
    if args.slo == "custom":
        slo = SLO(
            args.ttft,
            None if args.tpot_ms is None else args.tpot_ms / 1e3,
            None if args.p99_itl_ms is None else args.p99_itl_ms / 1e3,
            None if args.worst_gap_ms is None else args.worst_gap_ms / 1e3,
        )
        if slo == SLO():
            raise ValueError(
                "--slo custom needs at least one of --ttft, --tpot-ms, --p99-itl-ms, --worst-gap-ms"
            )
        return [("custom", slo)]
    named = {"average": [("average", SLO_AVERAGE)], "worst-gap": [("worst-gap", SLO_WORST_GAP)]}
    return named.get(args.slo, named["average"] + named["worst-gap"])


def cmd_goodput(args: argparse.Namespace) -> int:
    base, make = _base(args), workload_factory(args)
    designs, slos = _designs(args, base), _slos(args)
    if not 0 < args.target <= 1:
        raise ValueError("--target must be in (0, 1]")
    total = len(slos) * len(designs) * len(args.rates) * args.seeds
    results = []
    with progress(args, total, "goodput search") as tick:
        for slo_name, slo in slos:
            for name, dep in designs:
                gp = goodput(dep, make, slo, args.rates, args.target, args.seeds, tick)
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
    base, make = _base(args), workload_factory(args)
    rows = []
    with progress(args, len(args.rates) * len(args.budgets) * args.seeds, "sweeping budgets") as tick:
        for rate in args.rates:
            for budget in args.budgets:
                dep = replace(base, mode="collocated", sched=replace(base.sched, budget=budget))
                runs = []
                for s in range(args.seeds):
                    runs.append(simulate(dep, make(rate, s), seed=s))
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
                        replace(base, mode="collocated", sched=replace(base.sched, budget=b)),
                        make(rate, s),
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


def _advice(row: dict) -> str:
    """Turn the binding target and the pools' load into what to change."""
    load, why = row["load"], row["binding"]
    prefill_busy = load.get("prefill busy", load.get("busy", 0.0))
    if why.startswith("TTFT") and prefill_busy > 0.5:  # queueing for prefill sets TTFT
        side = "the prefill pool is" if "prefill busy" in load else "the replicas are"
        return f"{side} {prefill_busy:.0%} busy and TTFT binds: add prefill capacity (instances or TP)"
    if why.startswith("TTFT"):
        return "TTFT binds below saturation: the handoff or the prompt itself is too slow (TP, faster link)"
    if why.startswith(("TPOT", "worst gap", "p99 ITL")) and "busy" in load:
        return f"{why}: a smaller chunk budget or disaggregation"
    if why.startswith(("TPOT", "worst gap", "p99 ITL")):
        return f"{why}: more decode instances (batch {load['decode batch']:.0f} per step)"
    return f"what limits it: {why}"


def cmd_plan(args: argparse.Namespace) -> int:
    base, make = _base(args), workload_factory(args)
    require_positive(gpus=args.gpus, iters=args.iters, top=args.top)
    if not 0 < args.target <= 1:
        raise ValueError("--target must be in (0, 1]")
    if args.transfer_s is not None:
        base = replace(base, transfer=replace(base.transfer, fixed_s=args.transfer_s))
    (_, slo), *_ = _slos(args) if args.slo != "both" else [("average", SLO_AVERAGE)]
    prompt = int(np.mean(make(1.0, 0).prompt))
    n = len(layouts(base, args.gpus, args.tps, args.budgets))
    if n == 0:
        raise ValueError(f"no layout of TP sizes {args.tps} uses exactly {args.gpus} GPUs")
    with progress(args, search_steps(n, args.seeds, args.iters), f"planning {n} layouts") as tick:
        rows = plan(
            base,
            args.gpus,
            make,
            slo,
            prompt,
            args.tps,
            args.budgets,
            args.target,
            args.seeds,
            args.iters,
            tick,
        )
    out = [
        {
            "layout": r.label,
            "goodput": r.goodput,
            "goodput_per_gpu": r.goodput_per_gpu,
            "binding": r.binding,
            "load": r.busy,
            "gpus": r.deployment.gpus,
        }
        for r in rows
    ]
    lines = [
        f"{base.model.name} on {args.gpus}x {base.gpu.name}, SLO {slo.label()} for {args.target:.0%}",
        f"  {'#':>2s} {'layout':34s} {'goodput':>9s} {'per GPU':>8s}  {'load at goodput':36s} "
        "binds first above it",
    ]
    for i, r in enumerate(out[: args.top], 1):
        load = ", ".join(
            f"{k} {v:.0%}" if k.endswith("busy") else f"{k} {v:.1f}" for k, v in r["load"].items()
        )
        lines.append(
            f"  {i:2d} {r['layout']:34s} {r['goodput']:7.2f}/s {r['goodput_per_gpu']:8.2f}  {load:36s} "
            f"{r['binding']}"
        )
    if out:
        best = out[0]
        lines.append(f"recommendation: {best['layout']} ({best['goodput']:.2f} req/s); {_advice(best)}")
    return emit(args, {"slo": slo.label(), "layouts": out}, lines)
