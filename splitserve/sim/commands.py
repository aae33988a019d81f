"""The `splitserve sim` commands: each builds its rows with the sim modules, then prints a
table or JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from splitserve.sim import analysis, calibrate
from splitserve.sim.engine import SchedulerConfig
from splitserve.sim.kv import kv_report, required_gbps
from splitserve.sim.metrics import SLO, SLO_AVERAGE, SLO_WORST_GAP, goodput
from splitserve.sim.planner import layouts, plan, search_steps
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.simulator import Deployment, TransferConfig, simulate
from splitserve.sim.specs import load_gpu, load_model
from splitserve.sim.workload import Workload, WorkloadError, load_trace, sessions, synthetic

# The guide's measurements the seed quotes (Qwen2.5-7B, two L40S, 8k prompts, 256 outputs).
GUIDE = {
    "collocated_p99_itl_0.4": 0.169,
    "collocated_p99_itl_2.0": 0.263,
    "collocated_ttft_median": 0.7,
    "itl_median_lo": 0.021,
    "itl_median_hi": 0.024,
    "pd_ttft_median_1.3": 2.2,
}


# ---- shared helpers -----------------------------------------------------------------------
def _clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    return obj


def _emit(args: argparse.Namespace, data: object, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(_clean(data), indent=1))
    else:
        print("\n".join(lines))
    return 0


@contextlib.contextmanager
def _progress(args: argparse.Namespace, total: int, what: str) -> Iterator[Callable[[], None]]:
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


def _eff(args: argparse.Namespace) -> Efficiency:
    return Efficiency(args.eff_compute, args.eff_bandwidth, args.overhead_ms / 1e3, args.eff_attention)


def _positive(**values: float) -> None:
    for name, v in values.items():
        if v is None or not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")


def _base(args: argparse.Namespace) -> Deployment:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    _positive(budget=args.budget, link_gbps=args.link_gbps, replicas=args.replicas, tp=args.tp)
    realistic = args.preset == "realistic"
    sched = SchedulerConfig(budget=args.budget, max_prefills_per_step=None if realistic else 1)
    return Deployment(
        model,
        gpu,
        replicas=args.replicas,
        tp=args.tp,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        tp_prefill=args.tp_prefill,
        tp_decode=args.tp_decode,
        eff=_eff(args),
        combine="sum" if realistic else "max",
        sched=sched,
        routing=args.routing or ("random" if realistic else "round_robin"),
        transfer=TransferConfig(
            link_gbps=args.link_gbps,
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
                out.append((f"P/D, {base.transfer.link_gbps:g} Gb/s link", replace(base, mode="pd")))
        else:
            raise ValueError(f"unknown design {spec!r}: use collocated, pd or pd:SECONDS")
    return out


def _factory(args: argparse.Namespace) -> Callable[[float, int], Workload]:
    _positive(requests=args.requests, seeds=args.seeds, burstiness=args.burstiness)
    if args.trace:
        trace = load_trace(args.trace)
        span = float(trace.arrival.max()) or 1.0
        natural = len(trace) / span

        def from_trace(rate: float, seed: int) -> Workload:
            del seed
            return replace(trace, arrival=trace.arrival * (natural / rate))

        return from_trace

    if args.turns > 1:
        _positive(message=args.message)
        if args.think_s < 0:
            raise ValueError("--think-s must be >= 0")
        n_sessions = max(1, args.requests // args.turns)

        def chats(rate: float, seed: int) -> Workload:
            return sessions(
                rate,
                n_sessions,
                args.turns,
                int(args.prompt),
                args.message,
                int(args.output),
                args.think_s,
                args.stripped,
                seed=seed,
            )

        try:
            chats(1.0, 0)
        except ValueError as exc:
            raise WorkloadError(f"multi-turn needs plain integer --prompt/--output ({exc})") from exc
        return chats

    def make(rate: float, seed: int) -> Workload:
        return synthetic(rate, args.requests, args.prompt, args.output, seed=seed, burstiness=args.burstiness)

    make(1.0, 0)  # validate the length specs now, not inside a progress bar
    return make


def _mean_summary(dep: Deployment, make, rate: float, seeds: int, tick) -> dict[str, float]:
    runs = []
    for s in range(seeds):
        runs.append(simulate(dep, make(rate, s), seed=s).summary())
        tick()
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def _ms(x: float) -> str:
    return f"{x * 1e3:6.0f}ms"


# ---- closed-form commands -----------------------------------------------------------------
def cmd_kv(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    _positive(tokens=args.tokens, tp=args.tp)
    links = args.link_gbps or [400.0]
    _positive(link_gbps=min(links))
    rl = Roofline(model, gpu, _eff(args), tp=args.tp)
    prefill_s = rl.step_s(rl.prefill(args.tokens)) - rl.eff.overhead_s
    # the seed's estimate: 2 FLOPs per parameter per token, no attention, no all-reduce
    seed_prefill_s = 2 * model.total_params * args.tokens / (args.tp * gpu.peak_flops * args.eff_compute)
    achieved = gpu.peak_flops * args.eff_compute * args.tp
    reports = [kv_report(model, args.tokens, g, prefill_s)._asdict() for g in links]
    need = required_gbps(model, achieved)
    per = model.kv_bytes_per_token
    lines = [
        f"{model.name}: {per / 1024:.0f} KiB per token with {model.kv_heads} KV heads"
        + (
            ""
            if model.is_mla
            else f" (would be {model.mha_kv_bytes_per_token / 1024:.0f} KiB with full "
            f"multi-head attention, {model.heads // model.kv_heads}x more)"
        ),
        f"{args.tokens:,}-token prompt: {per * args.tokens / 1e9:.2f} GB "
        f"({per * args.tokens / 1e6:.0f} MB) of KV",
        f"prefill on {args.tp}x {gpu.name} at {args.eff_compute:.0%} of peak: {prefill_s * 1e3:.0f} ms "
        f"(2 FLOPs/parameter only: {seed_prefill_s * 1e3:.0f} ms); KV produced at {need:.1f} Gb/s",
        f"{'link':>12s} {'sent after prefill':>19s} {'streamed layer by layer':>24s}",
    ]
    for r in reports:
        lines.append(
            f"{r['link_gbps']:>8g} Gb/s {r['bulk_transfer_s'] * 1e3:16.1f} ms "
            f"{r['layerwise_exposed_s'] * 1e3:21.1f} ms"
        )
    data = {
        "model": model.name,
        "kv_bytes_per_token": per,
        "mha_kv_bytes_per_token": model.mha_kv_bytes_per_token,
        "tokens": args.tokens,
        "request_bytes": per * args.tokens,
        "prefill_s": prefill_s,
        "seed_model_prefill_s": seed_prefill_s,
        "required_gbps": need,
        "links": reports,
    }
    return _emit(args, data, lines)


def cmd_roofline(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    rl = Roofline(model, gpu, _eff(args), tp=args.tp)
    rows = [
        ("prefill, 8,192-token prompt", rl.prefill(8192)),
        ("prefill chunk, 2,048 tokens", rl.prefill(2048, past=3072)),
        ("decode step, 1 stream @ 8k ctx", rl.decode(1, 8192)),
        ("decode step, 2 streams @ 8k ctx", rl.decode(2, 2 * 8192)),
        ("decode step, 64 streams @ 1k ctx", rl.decode(64, 64 * 1024)),
    ]
    for n in args.prefill or []:
        _positive(prefill=n)
        rows.append((f"prefill, {n:,} tokens after {args.past:,}", rl.prefill(n, past=args.past)))
    for b in args.decode or []:
        _positive(decode=b)
        rows.append((f"decode step, {b} streams @ {args.context:,} ctx", rl.decode(b, b * args.context)))
    out = [
        {
            "workload": name,
            "flops": c.flops,
            "bytes": c.bytes,
            "intensity": c.intensity,
            "bound": rl.bound(c),
            "ideal_s": rl.ideal_s(c),
            "expected_s": rl.step_s(c),
        }
        for name, c in rows
    ]
    lines = [
        f"{model.name}: {model.layer_params / 1e9:.2f}B layer params + "
        f"{model.head_params / 1e9:.2f}B output head",
        f"{gpu.name} ridge point: {gpu.ridge:.0f} FLOPs per byte",
        "",
        f"{'workload':34s} {'FLOPs/byte':>10s} {'bound by':>9s} {'ideal time':>11s} {'expected':>10s}",
    ]
    for r in out:
        lines.append(
            f"{r['workload']:34s} {r['intensity']:10.0f} {r['bound']:>9s} {r['ideal_s'] * 1e3:9.1f} ms"
            f" {r['expected_s'] * 1e3:7.1f} ms"
        )
    data = {
        "model": model.name,
        "gpu": gpu.name,
        "layer_params": model.layer_params,
        "head_params": model.head_params,
        "ridge": gpu.ridge,
        "rows": out,
    }
    return _emit(args, data, lines)


def cmd_scenario(args: argparse.Namespace) -> int:
    rl = Roofline(load_model(args.model), load_gpu(args.gpu), _eff(args))
    cases = [
        ("shared worker, whole prompt", {}),
        ("shared worker, chunked (2,048)", {"chunk": 2048}),
        ("shared worker, chunked (512)", {"chunk": 512}),
        ("disaggregated, 20 ms transfer", {"transfer_s": 0.02}),
        ("disaggregated, 1.3 s transfer", {"transfer_s": 1.3}),
    ]
    rows = [{"case": name, **analysis.two_streams(rl, prompt=args.prompt_tokens, **kw)} for name, kw in cases]
    lines = [
        f"{r['case']:34s} N's first token after {r['n_ttft_s'] * 1e3:6.0f} ms | "
        f"A/B worst stall {r['ab_worst_stall_s'] * 1e3:5.0f} ms"
        for r in rows
    ]
    return _emit(args, rows, lines)


def cmd_multiturn(args: argparse.Namespace) -> int:
    rl = Roofline(load_model(args.model), load_gpu(args.gpu), _eff(args))
    _positive(turns=args.turns, first_prompt=args.first_prompt, message=args.message, answer=args.answer)
    rows = analysis.multiturn(rl, args.first_prompt, args.answer, args.message, args.turns)
    lines = [
        f"{'turn':>4s} {'history':>8s} | {'collocated + prefix cache':>26s} | {'P/D one-way':>18s} | "
        f"{'P/D bidirectional':>30s}"
    ]
    for r in rows:
        lines.append(
            f"{r['turn']:4d} {r['history']:8,d} | {r['new_tokens']:>6,d} new -> "
            f"{r['collocated_s'] * 1e3:5.0f} ms     | {r['one_way_tokens']:>5,d} -> "
            f"{r['one_way_s'] * 1e3:5.0f} ms | {r['new_tokens']:>5,d} -> {r['bidirectional_s'] * 1e3:5.0f}"
            f" ms + pull {r['pull_bytes'] / 2**20:3.0f} MiB"
        )
    return _emit(args, rows, lines)


def cmd_tp(args: argparse.Namespace) -> int:
    model, gpu, eff = load_model(args.model), load_gpu(args.gpu), _eff(args)
    _positive(prompt_tokens=args.prompt_tokens, context=args.context, itl_ms=args.itl_ms)
    pre = [analysis.prefill_pool(model, gpu, eff, args.prompt_tokens, tp) for tp in args.tps]
    dec = [analysis.decode_pool(model, gpu, eff, tp, args.context, args.itl_ms / 1e3) for tp in args.tps]
    lines = [f"Prefill pool: TTFT for one {args.prompt_tokens:,}-token prompt (roofline | seed's model)"]
    lines += [
        f"  TP={r['tp']}: {r['ttft_s'] * 1e3:5.0f} ms | {r['seed_model_ttft_s'] * 1e3:5.0f} ms" for r in pre
    ]
    lines += [
        f"Decode pool: largest batch at {args.context:,} context with ITL <= {args.itl_ms:g} ms",
        f"  {'layout':8s} {'batch':>6s} {'ITL':>8s} {'tok/s/GPU':>10s} {'seed ITL':>9s} "
        f"{'seed tok/s/GPU':>15s}  limited by",
    ]
    for r in dec:
        lines.append(
            f"  TP={r['tp']:<5d} {r['batch']:6d} {r['itl_s'] * 1e3:6.1f} ms "
            f"{r['tokens_per_s_per_gpu']:10,.0f}"
            f" {r['seed_model_itl_s'] * 1e3:6.1f} ms {r['seed_model_tokens_per_s_per_gpu']:15,.0f}"
            f"  {r['limited_by']}"
        )
    return _emit(args, {"prefill": pre, "decode": dec}, lines)


def cmd_cuts(args: argparse.Namespace) -> int:
    lm, moe = load_model(args.model), load_model(args.moe_model)
    if not moe.is_moe:
        raise ValueError(f"--moe-model {moe.name} is not a mixture-of-experts model")
    c = analysis.cut_points(lm, moe)
    ssm = analysis.mamba_break_even()
    mib = 2**20
    lines = [
        "Cut 1: encoder | prefill",
        f"  {c['embedding_bytes_per_token'] / 1024:.0f} KiB/token; {c['vision_tokens']} visual tokens -> "
        f"{c['images_embedding_bytes'] / mib:.1f} MiB (their KV cache: {c['images_kv_bytes'] / mib:.0f} MiB)",
        f"Cut 2: prefill | decode: {c['kv_bytes_per_token'] / 1024:.0f} KiB/token ({lm.name}), "
        "once per request",
        f"Cut 3: attention | FFN ({moe.name}): {c['af_bytes_per_token_per_pass'] / mib:.2f} MiB "
        "per token per "
        f"pass vs {c['moe_kv_bytes_per_token'] / 1024:.0f} KiB of KV: {c['af_over_kv']:.0f}x, every step",
        "  tokens per expert per step: "
        + ", ".join(f"{k}: {v:.0f}" for k, v in c["tokens_per_expert"].items()),
        f"Hybrid SSM: state {ssm['state_bytes'] / mib:.2f} MiB vs "
        f"{ssm['kv_bytes_per_token_layer'] / 1024:.0f} "
        f"KiB/token: break-even {ssm['break_even_tokens']:,.0f} tokens",
    ]
    return _emit(args, {**c, "ssm": ssm}, lines)


# ---- simulation commands ------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    base, make = _base(args), _factory(args)
    designs = _designs(args, base)
    rows = []
    with _progress(args, len(args.rates) * len(designs) * args.seeds, "simulating") as tick:
        for rate in args.rates:
            for name, dep in designs:
                rows.append(
                    {"rate": rate, "design": name, **_mean_summary(dep, make, rate, args.seeds, tick)}
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
            name: np.concatenate([simulate(dep, make(rate, s), s).itl() for s in range(args.seeds)])
            for name, dep in designs
        }
        plots.itl_cdf(args.plot, series, f"{base.model.name} on {base.gpu.name}: ITL CDF at {rate:g} req/s")
        lines.append(f"wrote {args.plot}")
    return _emit(args, {"rows": rows, "plot": args.plot}, lines)


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
    base, make = _base(args), _factory(args)
    designs, slos = _designs(args, base), _slos(args)
    if not 0 < args.target <= 1:
        raise ValueError("--target must be in (0, 1]")
    total = len(slos) * len(designs) * len(args.rates) * args.seeds
    results = []
    with _progress(args, total, "goodput search") as tick:
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
    return _emit(args, {"target": args.target, "results": results, "plot": args.plot}, lines)


def cmd_sweep_chunk(args: argparse.Namespace) -> int:
    base, make = _base(args), _factory(args)
    rows = []
    with _progress(args, len(args.rates) * len(args.budgets) * args.seeds, "sweeping budgets") as tick:
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
    return _emit(args, {"rows": rows, "plot": args.plot}, lines)


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
    model, gpu, make = load_model(args.model), load_gpu(args.gpu), _factory(args)
    variants = beyond_variants(Deployment(model, gpu, eff=_eff(args)))
    rows = []
    with _progress(args, len(variants) * len(args.rates) * args.seeds, "variants") as tick:
        for name, dep in variants:
            for rate in args.rates:
                rows.append(
                    {"variant": name, "rate": rate, **_mean_summary(dep, make, rate, args.seeds, tick)}
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
    return _emit(args, data, lines)


def cmd_plan(args: argparse.Namespace) -> int:
    base, make = _base(args), _factory(args)
    _positive(gpus=args.gpus, iters=args.iters, top=args.top)
    if args.transfer_s is not None:
        base = replace(base, transfer=replace(base.transfer, fixed_s=args.transfer_s))
    (_, slo), *_ = _slos(args) if args.slo != "both" else [("average", SLO_AVERAGE)]
    prompt = int(np.mean(make(1.0, 0).prompt))
    n = len(layouts(base, args.gpus, args.tps, args.budgets))
    if n == 0:
        raise ValueError(f"no layout of TP sizes {args.tps} uses exactly {args.gpus} GPUs")
    with _progress(args, search_steps(n, args.seeds, args.iters), f"planning {n} layouts") as tick:
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
            "gpus": r.deployment.gpus,
        }
        for r in rows
    ]
    lines = [
        f"{base.model.name} on {args.gpus}x {base.gpu.name}, SLO {slo.label()} for {args.target:.0%}",
        f"  {'#':>2s} {'layout':40s} {'goodput':>9s} {'per GPU':>8s}  binds first above it",
    ]
    for i, r in enumerate(out[: args.top], 1):
        lines.append(
            f"  {i:2d} {r['layout']:40s} {r['goodput']:7.2f}/s {r['goodput_per_gpu']:8.2f}  {r['binding']}"
        )
    if out:
        best = out[0]
        lines.append(
            f"recommendation: {best['layout']} ({best['goodput']:.2f} req/s); "
            f"what limits it: {best['binding']}"
        )
    return _emit(args, {"slo": slo.label(), "layouts": out}, lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    rl = Roofline(model, gpu, _eff(args), tp=args.tp)
    if args.synthetic:
        try:
            c, b, o = (float(x) for x in args.synthetic.split(","))
        except ValueError as exc:
            raise ValueError("--synthetic takes COMPUTE,BANDWIDTH,OVERHEAD_MS") from exc
        samples = calibrate.synthetic_samples(rl, Efficiency(c, b, o / 1e3))
        print(
            json.dumps({"model": model.name, "gpu": gpu.name, "samples": calibrate.samples_to_json(samples)})
        )
        return 0
    if not args.input:
        raise ValueError("give a JSON file of measured step times (or --synthetic C,B,OVERHEAD_MS)")
    samples, _ = calibrate.load_samples(args.input)
    res = calibrate.fit(rl, samples)
    data = {
        "compute": res.eff.compute,
        "bandwidth": res.eff.bandwidth,
        "overhead_s": res.eff.overhead_s,
        "samples": res.samples,
        "compute_bound_samples": res.compute_bound,
        "rms_rel_error": res.rms_rel_error,
        "max_rel_error": res.max_rel_error,
    }
    lines = [
        f"{model.name} on {args.tp}x {gpu.name}: {res.samples} samples ({res.compute_bound} compute-bound)",
        f"  compute efficiency   {res.eff.compute:.3f}  (--eff-compute)",
        f"  bandwidth efficiency {res.eff.bandwidth:.3f}  (--eff-bandwidth)",
        f"  overhead per step    {res.eff.overhead_s * 1e3:.2f} ms  (--overhead-ms)",
        f"  fit error: rms {res.rms_rel_error:.1%}, max {res.max_rel_error:.1%}",
    ]
    return _emit(args, data, lines)
