"""What `bench_sim_predicts_bench.py --measure` measures, on this machine: a profile
calibrated as bench_plan_pick.py does, then each layout (`serve`, `up --prefill 0 --decode
1`, `up --prefill 1 --decode 1`, `up --prefill 0 --decode 2`, pinned as the planner would
start them) measured by
`splitserve bench` after an unmeasured run, everything saved in one folder
(`measured.json` beside the profile, the runs and the step logs) for `--replay`.

A level near or past a layout's capacity is not reproducible from one start to the next on
a machine whose speed moves between processes: `--repeat` measures each layout twice, from
a fresh start each time, and `predict` prints how many figures the two runs agree on
within 10% beside the simulator's count (docs/sim.md). How `serve` and the bench client
are modelled beside the planner's layouts is here too (`serve_deployment`,
`with_client_cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import httpx

from splitserve.sim.deployment import Deployment
from splitserve.sim.host_planner import HostLayout

LAYOUTS = ("serve", "up serve-like", "up 1P+1D", "up 2 collocated")
WARM_UP = "-warm-up"  # a layout's unmeasured run: `stem`-warm-up.json
MEASURED = "measured.json"  # what --measure saved beside the profile and the runs, for --replay
REPEAT = "-repeat"  # the suffix of a layout's second measurement (`--repeat`)


def layout_of(name: str, cpus: Sequence[int]) -> tuple[list[str], HostLayout]:
    """A measured layout's command (`serve`, or `up` and its flags) and how the planner sees it."""
    half = len(cpus) // 2
    return {
        "serve": (["serve"], HostLayout(0, 1, (tuple(cpus),))),
        "up serve-like": (["up", "--prefill", "0", "--decode", "1"], HostLayout(0, 1, (tuple(cpus),))),
        "up 1P+1D": (
            ["up", "--prefill", "1", "--decode", "1"],
            HostLayout(1, 1, (tuple(cpus[:half]), tuple(cpus[half:]))),
        ),
        "up 2 collocated": (
            ["up", "--prefill", "0", "--decode", "2"],
            HostLayout(0, 2, (tuple(cpus[:half]), tuple(cpus[half:]))),
        ),
    }[name]


def proxy_routes(url: str) -> dict[str, float]:
    """The proxy's requests so far by path (decode_only, pd_push, pd_pull), from its /metrics."""
    found: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'^splitserve_proxy_requests_total\{path="(\w+)"\}\s+(\S+)$', line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def client_cpu_per_request(runs: list[tuple[int, float]]) -> float:
    """The load generator shares the cores it measures, so its CPU is charged to the
    engines (`with_client_cpu`; in production the clients run elsewhere). Each bench process
    also spends CPU once, starting (imports, tokenizer, prompts): the slope between the
    warm-up run and the measured one, which send different numbers of requests, leaves that
    out; with equal counts, the measured run's CPU over its requests (an overestimate)."""
    (warm_sent, warm_s), (sent, cpu_s) = runs
    if sent > warm_sent:
        return max(0.0, (cpu_s - warm_s) / (sent - warm_sent))
    return cpu_s / sent


def bench_run(
    args: argparse.Namespace, model: Path, url: str, rates: str, out: Path, seed: int, slo: str, requests: int
) -> tuple[int, float]:
    """One `splitserve bench` run at `rates` of `requests` each, saved to `out`: the requests
    it sent and the CPU seconds it spent (it shares the cores it measures:
    `client_cpu_per_request`)."""
    from bench_plan_pick import splitserve

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    bench = splitserve(
        "bench", "--url", url, "--tokenizer", str(model), "--endpoint", "completions",
        "--rate", rates, "--num-requests", str(requests), "--warmup", str(args.warmup),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--slo", slo,
        "--attainment", str(args.target), "--seed", str(seed), "--json", str(out), "--quiet",
    )  # fmt: skip
    subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return sum(len(level["requests"]) for level in json.loads(out.read_text())["levels"]), cpu_s


def measure(args: argparse.Namespace) -> Path:
    """Calibrate, then measure each layout with `splitserve bench` (and with `--repeat` once
    more, from a fresh start); returns the folder holding the profile, the runs and what
    `predict` needs."""
    from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model
    from bench_plan_pick import calibrate

    model, dtype = resolve_bench_model(args.model), compute_dtype()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"model {model}; ISA {cpu_isa_flags()}; dtype {dtype}; CPUs {cpus}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-sim-predicts-"))
    calibrate(args, model, dtype, folder / "profile.json")
    saved: dict = {"model": str(model), "dtype": dtype, "isa": cpu_isa_flags(), "cpus": cpus}
    saved |= {"budget": args.budget, "input_len": args.input_len, "layouts": {}, "repeats": {}}
    for name in args.layouts:
        stem = name.replace(" ", "-")
        saved["layouts"][name] = measure_layout(args, model, dtype, folder, name, stem)
        if args.repeat:
            saved["repeats"][name] = measure_layout(args, model, dtype, folder, name, f"{stem}{REPEAT}")
        (folder / MEASURED).write_text(json.dumps(saved, indent=1))
    print(f"measured: {folder} (--replay {folder} predicts it again)", flush=True)
    return folder


def measure_layout(
    args: argparse.Namespace, model: Path, dtype: str, folder: Path, name: str, stem: str
) -> dict:
    """Start layout `name`, bench it (an unmeasured run, then the measured one, saved as
    `stem`.json) and stop it; returns what `predict` needs of it."""
    from bench_plan_pick import WARM_UP_SEED, splitserve
    from bench_render import free_port, served

    cpus = sorted(os.sched_getaffinity(0))
    command, layout = layout_of(name, cpus)
    port = free_port()
    flags = ["--dtype", dtype, "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    argv = splitserve(command[0], str(model), *command[1:], "--port", str(port), *flags)
    for entry in layout.cpu_affinity(cpus):
        argv += ["--cpu-affinity", entry]
    if args.step_log:
        argv += ["--step-log", str(folder / f"{stem}-steps.jsonl")]
    slo = f"ttft={args.slo_ttft_ms}ms,gap={args.slo_gap_ms}ms"
    with served(argv, port, name) as url:
        # first an unmeasured run (a fresh stack's first burst builds its kernels per batch
        # shape) with prompts of its own: one the measured run sent again would be a
        # prefix-cache hit there. It sweeps the measured rates, a quarter of the requests
        # each, so that the steps it logs (which re-time the profile: `predict`) are of the
        # measured run's mix: at the highest rate alone, a one-thread engine's one-token
        # steps cost 5.7 ms of CPU where its measured run's cost 4.1-4.2 at every rate
        rates = ",".join(f"{r:g}" for r in args.rates)
        requests = max(20, args.num_requests // 4)
        warm_up = (rates, folder / f"{stem}{WARM_UP}.json", args.seed + WARM_UP_SEED, slo, requests)
        client_cpu = [bench_run(args, model, url, *warm_up)]
        measured_from = time.monotonic()
        routed_before = proxy_routes(url) if command[0] == "up" else {}
        measured = (rates, folder / f"{stem}.json", args.seed, slo, args.num_requests)
        client_cpu.append(bench_run(args, model, url, *measured))
        if command[0] == "up":  # how the proxy routed the measured run, and on what costs
            routed = {path: n - routed_before.get(path, 0.0) for path, n in proxy_routes(url).items()}
            workers = httpx.get(url + "/workers", timeout=30).json()
            proxy = {"routed": routed, "pd_costs": workers.get("pd_costs")}
        else:
            proxy = {}
    return {
        "argv": argv[3:],
        "client_s_per_request": client_cpu_per_request(client_cpu),
        "measured_from": measured_from if args.step_log else None,
        **proxy,
    }


def serve_deployment(dep: Deployment, prompt_tokens: int) -> Deployment:
    """`serve` as the profile sees it: one process, its engine's own scheduler (no
    long-prefill cap), and no proxy or render tier. Its OpenAI API is its own CPU: the
    engine API's (measured on `up`'s one-thread decode engine) and the tokenizing the render
    tier measured, also a delay before the engine sees the prompt; its detokenizing is not
    measured apart (in `up` it is part of the tiers' CPU per token) and counts nothing. Its
    way in and out is its API's (the engine API's time beyond its steps), where `up`'s is
    the proxy's."""
    uncapped = replace(dep.sched.scheduler, long_prefill_token_threshold=0)
    dep = replace(dep, sched=replace(dep.sched, scheduler=uncapped))
    if dep.cpu is None:
        return dep
    c = dep.cpu
    tokenize = c.render_s_per_request + c.render_s_per_token * prompt_tokens
    cpu = replace(
        c,
        proxy_s_per_request=c.api_s_per_request,
        cpu_s_per_request=0.0,
        cpu_s_per_remote_request=0.0,
        cpu_s_per_step=0.0,
        cpu_s_per_token=0.0,
        engine_s_per_request=c.engine_s_per_request + tokenize,
    )
    return replace(dep, cpu=cpu)


def with_client_cpu(dep: Deployment, client_s_per_token: float) -> Deployment:
    """The bench client's CPU, which it spends reading each streamed token, placed as the
    simulator places the tiers' CPU per streamed token, but costing the engine it lands
    beside a second per second of it, not `own_loss`: one process, on one core at a time.
    (Charged per request, at each arrival, the simulated prompt steps came out 20 ms longer
    than the engines logged them while their decode steps came out shorter; in four runs per
    token predicted `serve` and 1P+1D closer in every one: docs/sim.md.)"""
    if dep.cpu is None or client_s_per_token <= 0:
        return dep
    per_token = dep.cpu.cpu_s_per_token + client_s_per_token / dep.own_loss
    return replace(dep, cpu=replace(dep.cpu, cpu_s_per_token=per_token))
