"""Does `splitserve up --plan` pick the layout that measures best? Every layout this host's
cores allow is started and measured with `splitserve bench` at each of two rates, in one
run, beside the planner's pick at that rate from a profile calibrated in the same run.

1. Calibrate (unless `--profile FILE` is given): an `engine`, a `render` tier and a
   pinned `up --prefill 1 --decode 1` on the model, side by side and idle, while
   `splitserve sim calibrate --engine --engine --render --proxy --pd` probes them one at a
   time (the `up` stack's pinned decode engine is the one-core engine whose steps the
   one-core layouts use; its proxy and render tier are the tiers whose CPU is measured and
   its handoff the one timed); the profile is written to `--out-profile`.
2. Plan: `splitserve up MODEL --plan --rate R --profile P --lengths I/O --slo-ttft ..
   --slo-gap .. --dry-run` at each rate; its table and its pick are printed.
3. Measure: each candidate layout (`sim/host_planner.host_layouts` of this host's CPUs,
   as `--plan` enumerates them) started as `up --prefill P --decode D --cpu-affinity ..`,
   and `splitserve bench` at each rate (Poisson arrivals, `--num-requests`, the same SLO
   as the plan), after one unmeasured run at the highest rate (a fresh stack's first burst
   builds its kernels for each new batch shape). Its goodput at R is R x the fraction of
   requests meeting the SLO.

Last: per rate, the pick's measured goodput against the best measured layout's, and
whether it is within 10% (the planner issue's must-hold). The peer is the measured best
layout, in the same run.

    .venv/bin/python benchmarks/bench_plan_pick.py [--model bench|smollm2|DIR] [--rates 12 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model
from bench_render import free_port, served

from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from splitserve.sim.host_planner import HostLayout, host_layouts

WITHIN = 0.10
WARM_UP_SEED = 1000  # added to --seed for the unmeasured run: prompts no measured run sends


class Measured(NamedTuple):
    attainment: float  # fraction of measured requests meeting the SLO
    goodput: float  # rate x attainment (req/s meeting the SLO)
    ttft_p90_ms: float
    gap_p90_ms: float


def splitserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", *argv]


def engine_flags(args: argparse.Namespace, dtype: str) -> list[str]:
    return ["--dtype", dtype, "--max-model-len", str(args.max_model_len), "--log-level", "warning"]


def calibrate(args: argparse.Namespace, model: Path, dtype: str, out: Path) -> None:
    flags = engine_flags(args, dtype)
    ports = [free_port() for _ in range(3)]
    cpus = sorted(os.sched_getaffinity(0))
    pinned = f"prefill={cpus[0]},decode={cpus[-1]},render={cpus[0]},proxy={cpus[0]}"
    # the probe reads the stack's engines' and render tier's /metrics (their CPU, steps);
    # no lending, so that the prefill engine's CPU is its own thread's and its API's
    env = {INTERNAL_TOKEN_ENV: secrets.token_hex(16)}
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(
            served(splitserve("engine", str(model), "--port", str(ports[0]), *flags), ports[0], "engine")
        )
        render = stack.enter_context(
            served(
                splitserve("render", str(model), "--port", str(ports[1]), "--log-level", "warning"),
                ports[1],
                "render",
            )
        )
        up = splitserve(
            "up", str(model), "--port", str(ports[2]), "--prefill", "1", "--decode", "1",
            "--cpu-affinity", pinned, "--no-lend-idle-cpus", *flags,
        )  # fmt: skip
        pd = stack.enter_context(served(up, ports[2], "up-pd", env))
        # its decode engine runs on one pinned core: the step times of one-core layouts
        workers = httpx.get(pd + "/workers").json()["workers"]
        (one_core,) = [w["url"] for w in workers if w["role"] == "decode"]
        command = splitserve(
            "sim", "calibrate", "--engine", engine, "--engine", one_core, "--render", render,
            "--proxy", pd, "--pd", pd, "--model", str(model), "--out", str(out),
        )  # fmt: skip
        print(f"calibrating: {' '.join(command[3:])}", flush=True)
        subprocess.run(command, check=True, env={**os.environ, **env})


def plan(args: argparse.Namespace, model: Path, dtype: str, profile: Path, rate: float) -> str:
    """The label of the layout `up --plan` picks at `rate` ('' when none meets the target)."""
    command = splitserve(
        "up", str(model), "--plan", "--rate", f"{rate:g}", "--profile", str(profile), "--lengths",
        f"{args.input_len}/{args.output_len}", "--slo-ttft", f"{args.slo_ttft_ms}ms", "--slo-gap",
        f"{args.slo_gap_ms}ms", "--target", str(args.target), "--dry-run", *engine_flags(args, dtype),
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout, end="", flush=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"up --plan failed ({done.returncode}):\n{done.stderr[-3000:]}")
    picked = re.findall(r"^picked: (.+?) \(--prefill", done.stdout, re.M)
    return picked[0] if picked else ""


def bench(
    args: argparse.Namespace, base: str, model: Path, rate: float, results: Path, seed: int, requests: int
) -> Measured:
    """One `splitserve bench` run of `requests`. Each run of a stack gets its own `seed`: the
    same seed sends the same prompts, which the engines then answer from their prefix caches
    (a warm-up with the measured run's seed once made every measured prompt a cache hit)."""
    slo = f"ttft={args.slo_ttft_ms}ms,gap={args.slo_gap_ms}ms"
    command = splitserve(
        "bench", "--url", base, "--tokenizer", str(model), "--endpoint", "completions", "--rate", f"{rate:g}",
        "--num-requests", str(requests), "--warmup", str(args.warmup), "--input-len",
        str(args.input_len), "--output-len", str(args.output_len), "--slo", slo, "--attainment",
        str(args.target), "--seed", str(seed), "--json", str(results), "--quiet",
    )  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(results.read_text())["levels"][0]["summary"]
    (attainment,) = summary["attainment"].values()
    return Measured(
        attainment, rate * attainment, summary["ttft"]["p90"] * 1e3, summary["worst_gap"]["p90"] * 1e3
    )


def measure_layout(
    args: argparse.Namespace, model: Path, dtype: str, layout: HostLayout, cpus: list[int], folder: Path
) -> dict[float, Measured]:
    port = free_port()
    command = splitserve(
        "up", str(model), "--port", str(port), "--prefill", str(layout.prefill),
        "--decode", str(layout.decode), *engine_flags(args, dtype),
    )  # fmt: skip
    for entry in layout.cpu_affinity(cpus):
        command += ["--cpu-affinity", entry]
    print(f"\n{layout.label()}: {' '.join(command[3:])}", flush=True)
    figures = {}
    with served(command, port, "up-layout") as base:
        # not measured: a stack's first burst builds its kernels for each new batch shape
        # (oneDNN primitives), which made the first rate measured up to 1 s slower to TTFT
        warm_up = folder / "warm-up.json"
        bench(args, base, model, max(args.rates), warm_up, args.seed + WARM_UP_SEED, args.num_requests)
        for index, rate in enumerate(args.rates):
            results = folder / f"{layout.prefill}-{layout.decode}-{rate:g}.json"
            # the planner predicts the steady state: a run of a few seconds near capacity
            # measures the transient before its queue builds (at 20 req/s, 1P+1D met the
            # SLO for 91% of 100 requests and 39% of 400)
            requests = max(args.num_requests, round(rate * args.duration_s))
            figures[rate] = bench(args, base, model, rate, results, args.seed + index, requests)
            m = figures[rate]
            print(
                f"  {rate:g} req/s: attainment {m.attainment:.0%}, goodput {m.goodput:.2f} req/s, "
                f"TTFT p90 {m.ttft_p90_ms:.0f} ms, worst gap p90 {m.gap_p90_ms:.0f} ms",
                flush=True,
            )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="bench, smollm2, or a model directory")
    parser.add_argument("--rates", type=float, nargs=2, default=[12.0, 16.0])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=int, default=500)
    parser.add_argument("--slo-gap-ms", type=int, default=100)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--num-requests", type=int, default=60, help="the fewest per run (and the warm-up's)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="each measured run's arrivals span")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-engines", type=int, default=4, help="as up --plan-max-engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, help="a profile to plan with (default: calibrate now)")
    parser.add_argument("--out-profile", default=None, help="where the calibrated profile is written")
    args = parser.parse_args()

    model = resolve_bench_model(args.model)
    dtype = compute_dtype()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"model {model}; ISA {cpu_isa_flags()}; dtype {dtype}; CPUs {cpus}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-plan-pick-"))
    profile = Path(args.profile) if args.profile else Path(args.out_profile or folder / "profile.json")
    if not args.profile:
        calibrate(args, model, dtype, profile)
    picks = {rate: plan(args, model, dtype, profile, rate) for rate in args.rates}

    layouts = host_layouts(cpus, args.max_engines)
    measured = {
        layout.label(): measure_layout(args, model, dtype, layout, cpus, folder) for layout in layouts
    }

    print(
        f"\nmodel {model.name}, {dtype}, ISA {cpu_isa_flags()}, {len(cpus)} CPUs; prompts {args.input_len}, "
        f"outputs {args.output_len}; SLO TTFT <= {args.slo_ttft_ms} ms, no gap > {args.slo_gap_ms} ms"
    )
    failures = 0
    for rate in args.rates:
        print(f"\nat {rate:g} req/s (planner's pick: {picks[rate] or 'none meets the target'})")
        for label, figures in measured.items():
            m = figures[rate]
            mark = "  <- pick" if label == picks[rate] else ""
            print(f"  {label:<26} attainment {m.attainment:6.1%}  goodput {m.goodput:6.2f} req/s{mark}")
        best_label = max(measured, key=lambda label: measured[label][rate].goodput)
        best = measured[best_label][rate].goodput
        if not picks[rate]:
            print(f"  no pick; the best measured: {best_label} ({best:.2f} req/s)")
            failures += 1
            continue
        mine = measured[picks[rate]][rate].goodput
        ratio = mine / best if best > 0 else 1.0
        ok = ratio >= 1 - WITHIN
        failures += not ok
        print(
            f"ratio pick / best measured ({best_label}) at {rate:g} req/s: {ratio:.2f}x "
            f"({'within' if ok else 'NOT within'} {WITHIN:.0%})"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
