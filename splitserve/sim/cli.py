"""`splitserve sim <command>`: the seed's analyses, the simulator, goodput and the planner.
Every command prints a table, or JSON with --json; bad input exits non-zero with a message."""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.sim import (
    cmd_afd,
    cmd_analysis,
    cmd_checks,
    cmd_cpu_tier,
    cmd_plan,
    cmd_profile,
    cmd_simulation,
    cpu_tier,
)
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.specs import SpecError
from splitserve.sim.workload import WorkloadError


def _common(
    p: argparse.ArgumentParser, model: str = "Qwen2.5-7B", gpu: str = "L40S", compute: float = 0.47
) -> None:
    p.add_argument("--model", default=model, help="built-in name or a HF config.json path/dir")
    p.add_argument(
        "--gpu", default=gpu, help="built-in name (L40S, A100-80G, H100-SXM, H200, B200, Ascend-910C) or JSON"
    )
    p.add_argument("--eff-compute", type=float, default=compute, help="achieved fraction of peak FLOP/s")
    p.add_argument(
        "--eff-bandwidth", type=float, default=None, help="achieved fraction of peak bandwidth (preset's)"
    )
    p.add_argument("--eff-attention", type=float, default=None, help="prefill attention's fraction of peak")
    p.add_argument(
        "--eff-kv-bandwidth", type=float, default=None, help="decode attention's fraction of peak bandwidth"
    )
    p.add_argument("--overhead-ms", type=float, default=None, help="fixed cost per step (preset's)")
    p.add_argument("--per-seq-overhead-ms", type=float, default=0.0, help="cost per sequence in a step")
    p.add_argument(
        "--small-chunk-tokens",
        type=float,
        default=None,
        help="a prefill step computes as if it had this many more tokens (small chunks run "
        "below peak; the preset's by default)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _workload(p: argparse.ArgumentParser, seeds: int = 5) -> None:
    p.add_argument("--requests", type=int, default=100, help="requests per run")
    p.add_argument("--prompt", default="8192", help="N, uniform:LO:HI, normal:M:S, exp:M, lognormal:MED:SIG")
    p.add_argument("--output", default="256", help="output tokens (same forms as --prompt)")
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape (vLLM's): 1 Poisson, <1 burstier"
    )
    p.add_argument("--trace", default=None, help="replay a CSV/JSONL trace instead (rates scale its time)")
    p.add_argument(
        "--lengths",
        default=None,
        metavar="FILE",
        help="draw (prompt, output) pairs from observed requests: JSONL of token counts, a "
        "`splitserve bench` dataset or a `bench --json` results file (instead of --prompt/--output)",
    )
    p.add_argument("--seeds", type=int, default=seeds, help="runs averaged per point")
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="> 1: multi-turn sessions (--requests/turns sessions arriving at the rate; --prompt "
        "is the first prompt, --output each answer)",
    )
    p.add_argument("--message", type=int, default=400, help="tokens of each follow-up message")
    p.add_argument("--think-s", type=float, default=5.0, help="user think time between turns")
    p.add_argument(
        "--stripped",
        type=int,
        default=0,
        help="tokens of each answer the chat template drops next turn (reasoning)",
    )


def _deployment(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="a measured engine (`sim calibrate --engine URL --out FILE`): its fitted step "
        "times, render cost and P/D decision costs replace the roofline's",
    )
    p.add_argument(
        "--pd-decision",
        choices=["always", "cost"],
        default=None,
        help="P/D: every request through a prefill worker (always), or each on cost as the "
        "proxy's --pd-decision cost (default: cost with --profile, else always)",
    )
    p.add_argument(
        "--preset",
        choices=["seed", "realistic"],
        default="realistic",
        help="realistic (default): per-kernel step times, small-chunk efficiency, several "
        "prompts per step, KV memory limit, least-loaded routing as splitserve's router; "
        "seed: the seed's simulator",
    )
    p.add_argument("--replicas", type=int, default=2, help="collocated instances")
    p.add_argument("--tp", type=int, default=1, help="GPUs per collocated instance")
    p.add_argument("--prefill-instances", type=int, default=1)
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument("--tp-prefill", type=int, default=1)
    p.add_argument("--tp-decode", type=int, default=1)
    p.add_argument("--budget", type=int, default=2048, help="tokens per collocated step")
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        help="tokens per P/D prefill step (default: one whole prompt per step)",
    )
    p.add_argument("--routing", choices=["round_robin", "random", "least_loaded"], default=None)
    p.add_argument(
        "--step-time",
        choices=["max", "sum"],
        default=None,
        help="max: one roofline per step (seed; what `sim calibrate` fits); sum: per kernel (realistic)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="KV link when no fixed transfer time (default: the GPU's NIC/PCIe path)",
    )
    p.add_argument("--transfer-overhead-ms", type=float, default=0.0)
    p.add_argument(
        "--kv-mode",
        choices=["push", "pull"],
        default="push",
        help="push: KV streamed layer by layer during prefill (splitserve's default); pull: "
        "after prefill, once decode next checks between steps (vLLM NIXL)",
    )
    p.add_argument("--kv-limit", action="store_true", help="enforce KV memory capacity")
    p.add_argument(
        "--bidirectional",
        action="store_true",
        help="multi-turn P/D: prefill pulls the last answer's KV back from decode",
    )
    p.add_argument(
        "--design",
        action="append",
        default=None,
        help="collocated | pd | pd:SECONDS (fixed handoff); repeatable "
        "(default: collocated, pd:1.3, pd:0.02 as in the seed)",
    )


def _slo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slo",
        choices=["average", "worst-gap", "both", "custom"],
        default="both",
        help="the seed's targets, or custom from the flags below",
    )
    p.add_argument("--ttft", type=float, default=None, help="custom SLO: TTFT seconds")
    p.add_argument("--tpot-ms", type=float, default=None)
    p.add_argument("--p99-itl-ms", type=float, default=None)
    p.add_argument("--worst-gap-ms", type=float, default=None)
    p.add_argument("--target", type=float, default=0.9, help="fraction of requests that must meet the SLO")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad rate list {text!r}") from exc
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("rates must be > 0")
    return rates


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad integer list {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("kv", help="KV bytes per token/request, transfer time, layer-wise exposure")
    _common(p, model="Llama-3.1-70B", gpu="H100-SXM", compute=0.45)
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--link-gbps", type=float, action="append", default=None, help="repeatable (default 400)")
    p.add_argument("--tp", type=int, default=8, help="GPUs doing the prefill (for the layer-wise overlap)")

    p = sub.add_parser("roofline", help="FLOPs, bytes, bound and ideal/expected time of steps")
    _common(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prefill", type=int, action="append", default=None, help="extra prefill row: N tokens")
    p.add_argument("--past", type=int, default=0, help="cached tokens before the extra prefill rows")
    p.add_argument("--decode", type=int, action="append", default=None, help="extra decode row: batch")
    p.add_argument("--context", type=int, default=8192, help="context per sequence of the extra decode rows")

    p = sub.add_parser("scenario", help="two streams and one long prompt: who waits? (the seed's opening)")
    _common(p)
    p.add_argument("--prompt-tokens", type=int, default=8192)

    for name, help_ in (
        ("simulate", "median TTFT and ITL p50/p99 per rate and design"),
        ("goodput", "SLO attainment per rate and design, and goodput"),
        ("sweep-chunk", "collocated chunk budget sweep: TTFT, p99 ITL, worst gap"),
    ):
        p = sub.add_parser(name, help=help_)
        _common(p)
        _workload(p)
        _deployment(p)
        default_rates = {
            "simulate": "0.2,0.4,0.6,1.0,1.5,2.0",
            "goodput": "0.2,0.4,0.6,0.8,1.0,1.2,1.5",
            "sweep-chunk": "0.4,1.0",
        }[name]
        p.add_argument("--rates", type=_rates, default=_rates(default_rates))
        if name == "goodput":
            _slo(p)
        if name == "sweep-chunk":
            p.add_argument("--budgets", type=_ints, default=[512, 1024, 2048, 4096, 8192])
        p.add_argument("--plot", default=None, help="write a PNG (attainment vs rate, or ITL CDF)")
        if name == "simulate":
            p.add_argument("--records", default=None, help="write every request's record (JSON lines)")

    p = sub.add_parser(
        "beyond", help="what the seed's simulator misses, against the guide's 263 ms at 2 req/s"
    )
    _common(p)
    _workload(p)
    p.add_argument("--rates", type=_rates, default=_rates("0.4,1.0,2.0"))

    p = sub.add_parser("multiturn", help="prefill work per turn: collocated, one-way and bidirectional P/D")
    _common(p)
    p.add_argument("--first-prompt", type=int, default=4000)
    p.add_argument("--answer", type=int, default=600)
    p.add_argument("--message", type=int, default=400)
    p.add_argument("--turns", type=int, default=6)

    p = sub.add_parser("tp", help="prefill TTFT and decode batch per TP size (two pools, two questions)")
    _common(p, model="Llama-3.1-70B", gpu="H100-SXM", compute=0.45)
    p.add_argument("--tps", type=_ints, default=[4, 8])
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--itl-ms", type=float, default=40.0)

    p = sub.add_parser("cuts", help="what crosses each cut: embeddings, KV cache, MoE hidden states")
    _common(p)
    p.add_argument("--moe-model", default="DeepSeek-V3")
    p.add_argument(
        "--hybrid-model",
        default="Nemotron-3-Nano-seed",
        help="a hybrid (Mamba + attention) model for the state-vs-KV figure (default: the seed's example)",
    )
    p.add_argument("--hybrid-tp", type=int, default=2, help="GPUs the hybrid's layers are split over")

    p = sub.add_parser(
        "afd", help="attention-FFN disaggregation vs expert parallelism; the attention:FFN ratio"
    )
    # the plugin's published benchmark ran DeepSeek-V3.2 (DSA); --model DeepSeek-V3 is dense MLA
    _common(p, model="DeepSeek-V3.2", gpu="Ascend-910C")
    cmd_afd.add_afd_arguments(p)

    p = sub.add_parser("plan", help="the cheapest layouts that meet the SLO at a request rate")
    _common(p)
    _workload(p, seeds=1)
    _deployment(p)
    _slo(p)
    p.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    p.add_argument("--max-gpus", type=int, default=8, help="largest GPU count to consider")
    p.add_argument("--tps", type=_ints, default=[1], help="TP sizes to consider per instance")
    p.add_argument("--budgets", type=_ints, default=[512, 2048, 8192], help="collocated chunk budgets")
    p.add_argument("--transfer-s", type=float, default=None, help="fixed handoff for the P/D layouts")
    p.add_argument("--iters", type=int, default=5, help="bisection steps for each plan's headroom")
    p.add_argument("--half-width", type=float, default=0.02, help="stop a run when the 95%% CI is this tight")
    p.add_argument("--max-requests", type=int, default=6400, help="longest steady-state run")

    p = sub.add_parser("cpu-tier", help="stateless derender replay work and render CPU cost (seed vs ours)")
    p.add_argument(
        "--us-per-token", type=float, default=cpu_tier.GUIDE_US_PER_TOKEN, help="CPU per prompt token"
    )
    p.add_argument(
        "--image-ms", type=float, default=cpu_tier.SEED_IMAGE_MS, help="CPU per image preprocessed"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("payload", help="one image's bytes at each hop of the EPD pipeline (seed vs ours)")
    p.add_argument("--model", default="Qwen2.5-7B", help="the language model the visual tokens feed")
    p.add_argument("--jpeg-bytes", type=float, default=cpu_tier.SEED_JPEG_MIB * cpu_tier.MIB)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("reproduce", help="every seed figure next to splitserve's, with the error")
    p.add_argument("--seeds", type=int, default=5, help="runs averaged per simulated figure")
    p.add_argument(
        "--seed-arrivals",
        action="store_true",
        help="the seed's whole serving, goodput and chunk-sweep tables, cell by cell",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("retime", help="a profile's step times re-timed from a live engine's --step-log")
    p.add_argument("--profile", required=True, help="a `sim calibrate --engine URL --out FILE` profile")
    p.add_argument("--step-log", required=True, metavar="FILE", help="an engine's (or `up`'s) --step-log")
    p.add_argument(
        "--before",
        type=float,
        default=None,
        metavar="T",
        help="only the steps logged before T (CLOCK_MONOTONIC seconds, the log's `t`)",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the re-timed profile")
    p.add_argument(
        "--waits",
        action="store_true",
        help="fit the steps' waits for a core too (sim/step_waits.py), for predicting the layout that "
        "logged them: the simulator puts them beside its steps instead of placing the tiers' CPU",
    )
    p.add_argument(
        "--bench",
        default=None,
        metavar="RUN.json",
        help="a `splitserve bench --json` run of the same layout: fit the path around the engines "
        "(render, proxy, client) and each later token's relay back (derender, send) as they grow "
        "with the requests in flight (sim/path_latency.py)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("calibrate", help="fit efficiency factors to measured step times (JSON)")
    _common(p)
    p.add_argument("input", nargs="?", help="JSON of samples (see docs/sim.md)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--synthetic",
        default=None,
        metavar="C,B,OVERHEAD_MS[,ATTN,PER_SEQ_MS,SMALL_CHUNK_TOKENS]",
        help="write samples a GPU at these factors would report (to stdout) instead",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="URL",
        help="measure step times on a live engine instead; again for engines of other thread "
        "counts (e.g. one on a single core: the planner's one-core layouts), with --out",
    )
    p.add_argument("--save", default=None, metavar="FILE", help="with --engine: write the measured samples")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the engine profile (fitted step times, tier costs) for --profile and "
        "`proxy --pd-cost-profile`",
    )
    p.add_argument(
        "--render", default=None, metavar="URL", help="with --engine: also time a render tier's requests"
    )
    p.add_argument(
        "--proxy",
        default=None,
        metavar="URL",
        help="with --engine: `up`'s proxy, whose delay per request and whose and its render "
        "tier's CPU per request, remote request, step and streamed token to measure (their "
        "/metrics; engines' and render's with $SPLITSERVE_INTERNAL_TOKEN)",
    )
    p.add_argument(
        "--pd",
        default=None,
        metavar="URL",
        help="with --engine: a P/D proxy (`up --prefill N --decode M`) whose handoff to time",
    )
    p.add_argument("--probe-prefill", type=_ints, default=[32, 64, 128, 256, 512, 1024], help="prompt sizes")
    p.add_argument("--probe-batches", type=_ints, default=[1, 2, 4, 8, 16], help="decode batch sizes")
    p.add_argument("--probe-contexts", type=_ints, default=[128, 1024], help="decode-batch prompt sizes")
    p.add_argument("--repeats", type=int, default=3, help="with --engine: runs per shape (fastest kept)")
    p.add_argument("--fit-attention", action="store_true", help="fit prefill attention's efficiency apart")
    p.add_argument("--fit-per-seq", action="store_true", help="fit a per-sequence overhead too")
    p.add_argument(
        "--fit-kv-bandwidth",
        action="store_true",
        help="fit decode attention's bandwidth apart (needs contexts)",
    )
    p.add_argument(
        "--fit-small-chunk",
        action="store_true",
        help="fit the small-chunk tokens (needs prompts of several sizes)",
    )


def run(args: argparse.Namespace) -> int:
    name = "cmd_" + args.sim_command.replace("-", "_")
    modules = (cmd_analysis, cmd_simulation, cmd_checks, cmd_plan, cmd_cpu_tier, cmd_afd, cmd_profile)
    handler = next(getattr(m, name) for m in modules if hasattr(m, name))
    try:
        return int(handler(args) or 0)
    except BrokenPipeError:  # `splitserve sim ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (SpecError, WorkloadError, CalibrationError, ValueError) as exc:
        print(f"splitserve sim {args.sim_command}: error: {exc}", file=sys.stderr)
        return 2
