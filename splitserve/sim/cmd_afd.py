"""`splitserve sim afd`: attention-FFN disaggregation of a MoE model's decode against expert
parallelism, and the attention:FFN ratio that gives the most output per chip."""

from __future__ import annotations

import argparse

from rich import box
from rich.console import Console
from rich.table import Table

from splitserve.sim.afd import (
    ALL_TO_ALL_LATENCY,
    ATTENTION_WEIGHTS,
    AFDModel,
    AFDRun,
    compare,
    parse_layouts,
    ratio_layouts,
)
from splitserve.sim.afd_sweep import parse_sweep, spans, sweep_concurrency
from splitserve.sim.cmd_common import efficiency, emit, require_positive
from splitserve.sim.specs import load_gpu, load_model

ATTENTION_HOLDS = {
    "split": "attention chips hold their own weights",
    "ep": "attention chips hold an EP chip's weights",
}


def add_afd_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chips", type=int, default=80, help="chips to split into attention and FFN")
    p.add_argument(
        "--layouts",
        default=None,
        metavar="A:F,...",
        help="evaluate these attention:FFN layouts instead of every split of --chips (e.g. 48:16,64:16)",
    )
    p.add_argument(
        "--baseline", type=int, default=None, help="expert-parallel chips to compare with (--chips)"
    )
    p.add_argument("--context", type=int, default=16384, help="tokens each decode sequence attends to")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="decode sequences per attention chip in every layout (default: what each chip's KV room holds)",
    )
    p.add_argument(
        "--ep-batch",
        type=int,
        default=None,
        help="decode sequences per chip of the EP layouts (the baseline), where it differs from --batch",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="decode sequences over the whole deployment, split evenly across its attention chips "
        "(an EP chip is one); each layout's attention chips must hold their KV",
    )
    p.add_argument(
        "--sweep-concurrency",
        default=None,
        metavar="START:STOP:STEP",
        help="--concurrency at each of these values: a table, and where each layout is faster or slower",
    )
    p.add_argument(
        "--experts-per-rank",
        type=int,
        default=None,
        help="forced expert balancing: each EP or FFN chip computes only this many of its experts, "
        "every token routed to them (the plugin's force_load_balance_topn_per_rank)",
    )
    p.add_argument(
        "--attention-weights",
        choices=ATTENTION_WEIGHTS,
        default="split",
        help="what an attention chip holds: split = attention, dense layers, embeddings and head only "
        "(the experts are on the FFN chips); ep = what an EP chip of the baseline holds (its batch)",
    )
    p.add_argument(
        "--all-to-all-latency",
        choices=ALL_TO_ALL_LATENCY,
        default="deepep",
        help="fixed latency of a dispatch/combine: deepep = DeepEP's measured low-latency kernels beyond "
        "their bytes, by rank count (H800, InfiniBand); ascend = DeepEP-Ascend's (Atlas A3, HCCS); "
        "fixed = 20 us whatever the ranks",
    )
    p.add_argument("--no-overlap", action="store_true", help="no dual micro-batch overlap")
    p.add_argument(
        "--no-ep-overlap",
        action="store_true",
        help="no dual micro-batch overlap in the EP layouts (AFD's keep it, as in the plugin's recipe)",
    )
    p.add_argument("--link-gbps", type=float, default=None, help="attention<->FFN link per chip (the chip's)")
    p.add_argument(
        "--weight-bytes",
        type=int,
        default=1,
        help="bytes per weight (1: FP8/INT8 as DeepSeek-V3 ships and the plugin's W8A8 runs)",
    )


def cmd_afd(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    require_positive(chips=args.chips, context=args.context)
    for name in ("link_gbps", "batch", "ep_batch", "concurrency", "experts_per_rank"):
        if getattr(args, name) is not None:
            require_positive(**{name: getattr(args, name)})
    given = [f for f, v in (("--batch", args.batch), ("--ep-batch", args.ep_batch)) if v is not None]
    for flag in ("--concurrency", "--sweep-concurrency"):
        if getattr(args, flag[2:].replace("-", "_")) is not None and given:
            raise ValueError(f"{flag} sets the batch per attention chip: not with {given[0]}")
    if args.concurrency is not None and args.sweep_concurrency is not None:
        raise ValueError("--concurrency and --sweep-concurrency: give one")
    run = AFDRun(
        context=args.context,
        batch=args.batch,
        ep_batch=args.ep_batch,
        concurrency=args.concurrency,
        overlap=not args.no_overlap,
        ep_overlap=not args.no_ep_overlap,
        experts_per_rank=args.experts_per_rank,
        link_bw=None if args.link_gbps is None else args.link_gbps * 1e9 / 8,
        weight_bytes=args.weight_bytes,
        attention_weights=args.attention_weights,
        all_to_all_latency=args.all_to_all_latency,
    )
    afd = AFDModel(model, gpu, efficiency(args), run)
    layouts = parse_layouts(args.layouts) if args.layouts else ratio_layouts(args.chips, model.experts)
    baseline = args.baseline or (args.chips if not args.layouts else max(lay.chips for lay in layouts))
    require_positive(baseline=baseline)
    if args.sweep_concurrency is not None:
        values = parse_sweep(args.sweep_concurrency)
        return show_sweep(args, sweep_concurrency(afd, baseline, layouts, values))
    result = compare(afd, baseline, layouts)
    if args.json:
        return emit(args, {"model": model.name, "gpu": gpu.name, "context": args.context, **result}, [])
    base = result["baseline"]
    sparse = (
        f", sparse attention over the top {model.attended_tokens(args.context):,}"
        if model.is_sparse_attention
        else ""
    )
    table = Table(
        title=f"{model.name} decode on {gpu.name}: sequences of {args.context:,} tokens{sparse} "
        f"({base['memory']['kv_bytes_per_sequence'] / 1e9:.2f} GB of KV each), "
        f"{ATTENTION_HOLDS[run.attention_weights]}, "
        f"{'dual micro-batch overlap' if run.overlap else 'no overlap'}",
        box=box.SIMPLE_HEAVY,
    )
    for col in (
        "layout",
        "chips",
        "tok/s per chip",
        f"vs {base['layout']}",
        "ITL",
        "tokens/expert",
        "FFN busy",
        "batch",
        "GB: weights + KV | FFN",
    ):
        table.add_column(col, justify="left" if col == "layout" else "right")
    table.add_column("bound by")
    for r in result["layouts"]:
        mark = " (best)" if r["layout"] == result["best"] else ""
        busy = "-" if r["ffn_busy"] is None else f"{r['ffn_busy']:.0%}"
        table.add_row(
            r["layout"] + mark + ("" if r["fits"] else " (experts do not fit)"),
            str(r["chips"]),
            f"{r['tokens_per_s_per_chip']:,.0f}",
            f"{r['vs_baseline']:+.1%}",
            f"{r['step_s'] * 1e3:.1f} ms",
            f"{r['tokens_per_expert']:,.0f}",
            busy,
            f"{r['batch_per_attention_chip']:,.4g}",
            memory_split(r["memory"]),
            r["bound"],
        )
    console = Console(width=170)
    console.print(table)
    console.print(
        f"baseline {base['layout']}: {base['tokens_per_s_per_chip']:,.0f} tok/s per chip, ITL "
        f"{base['step_s'] * 1e3:.1f} ms, {base['batch_per_attention_chip']:,.4g} sequences per chip "
        f"({memory_split(base['memory'])} GB); best: {result['best']}"
    )
    return 0


def memory_split(memory: dict) -> str:
    """`17.1 + 97.9 | 14.3`: an attention (or EP) chip's weights and KV, an FFN chip's weights."""
    ffn = f" | {memory['ffn_weight_bytes'] / 1e9:.1f}" if memory["ffn_weight_bytes"] else ""
    return f"{memory['attention_weight_bytes'] / 1e9:.1f} + {memory['attention_kv_bytes'] / 1e9:.1f}{ffn}"


def show_sweep(args: argparse.Namespace, sweep: dict) -> int:
    """The sweep as a table (per chip and against the baseline at each concurrency) and, per
    layout, the concurrencies at which it is faster or slower than the baseline; or JSON."""
    if args.json:
        return emit(args, {"model": args.model, "gpu": args.gpu, "context": args.context, **sweep}, [])
    labels = list(sweep["signs"])
    table = Table(
        title=f"{args.model} decode on {args.gpu}, {args.context:,}-token sequences: tok/s per chip "
        f"at each total concurrency (sequences over the deployment)",
        box=box.SIMPLE_HEAVY,
    )
    for col in ("concurrency", sweep["baseline"], *labels):
        table.add_column(col, justify="right")
    for p in sweep["points"]:
        if p["skipped"]:
            table.add_row(f"{p['concurrency']:,}", "-", *["-"] * len(labels))
            continue
        cells = [
            f"{p['layouts'][lab]['tokens_per_s_per_chip']:,.1f} ({p['layouts'][lab]['vs_baseline']:+.1%}, "
            f"{p['layouts'][lab]['bound']})"
            for lab in labels
        ]
        table.add_row(f"{p['concurrency']:,}", f"{p['baseline_tokens_per_s_per_chip']:,.1f}", *cells)
    console = Console(width=170)
    console.print(table)
    grid = [p["concurrency"] for p in sweep["points"]]
    for lab, sign in sweep["signs"].items():
        console.print(
            f"{lab} vs {sweep['baseline']}: faster at {spans(sign['faster'], grid)}; "
            f"slower at {spans(sign['slower'], grid)}"
        )
    skipped = [p for p in sweep["points"] if p["skipped"]]
    if skipped:
        console.print(
            f"not run at {spans([p['concurrency'] for p in skipped], grid)} (first: {skipped[0]['skipped']})"
        )
    return 0
