"""What `bench_sim_predicts_bench.py --measure` measures, on this machine: a profile
calibrated as bench_plan_pick.py does, then each layout (`serve`, `up --prefill 0 --decode
1`, `up --prefill 1 --decode 1`, `up --prefill 0 --decode 2`, pinned as the planner would
start them) measured by
`splitserve bench` after an unmeasured run (with `--per-level`, one before each level),
everything saved in one folder (`measured.json` beside the profile, the runs, the step
logs and the clock windows of each run) for `--replay`.

A level near or past a layout's capacity is not reproducible from one start to the next on
a machine whose speed moves between processes: `--repeat N` measures each layout N times
more, from a fresh start each time, in rounds spread over the run (`measure_rounds`), and
`predict` sets the median of the rounds' predictions beside the median of their
measurements, and prints how many figures each round agrees on with the median of the
others within 10% beside the simulator's count (docs/sim.md). How `serve` and the bench client
are modelled beside the planner's layouts is here too (`serve_deployment`,
`with_client_cpu`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import httpx

from splitserve.config import UP_LONG_PREFILL_TOKEN_THRESHOLD, SchedulerConfig
from splitserve.goodput import distserve_goodput
from splitserve.protocol.step_record import StepRecord
from splitserve.sim.deployment import Deployment
from splitserve.sim.host_planner import HostLayout, host_deployment, layout_deployment
from splitserve.sim.profile import EngineProfile
from splitserve.sim.specs import ModelSpec

LAYOUTS = ("serve", "up serve-like", "up 1P+1D", "up 2 collocated")
WARM_UP = "-warm-up"  # a layout's unmeasured run: `stem`-warm-up.json
MEASURED = "measured.json"  # what --measure saved beside the profile and the runs, for --replay
REPEAT = "-repeat"  # a layout's k-th measurement after its first: `stem`-repeat-k (`--repeat`)


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
    """Calibrate, then measure each layout with `splitserve bench` (with `--repeat N`, N
    rounds more, each from a fresh start: `measure_rounds`); returns the folder holding the
    profile, the runs and what `predict` needs."""
    from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model
    from bench_plan_pick import calibrate

    model, dtype = resolve_bench_model(args.model), compute_dtype()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"model {model}; ISA {cpu_isa_flags()}; dtype {dtype}; CPUs {cpus}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-sim-predicts-"))
    calibrate(args, model, dtype, folder / "profile.json")
    saved: dict = {"model": str(model), "dtype": dtype, "isa": cpu_isa_flags(), "cpus": cpus}
    saved |= {"budget": args.budget, "input_len": args.input_len, "layouts": {}, "repeats": {}}
    for k, name in measure_rounds(args.layouts, args.repeat):
        stem = name.replace(" ", "-") + (f"{REPEAT}-{k}" if k else "")
        measured = measure_layout(args, model, dtype, folder, name, stem)
        if k:
            saved["repeats"].setdefault(name, []).append(measured)
        else:
            saved["layouts"][name] = measured
        (folder / MEASURED).write_text(json.dumps(saved, indent=1))
    print(f"measured: {folder} (--replay {folder} predicts it again)", flush=True)
    return folder


def measure_rounds(layouts: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(round, layout) in the order they are measured: every layout once a round, each
    round starting one layout further on, so that a layout's rounds are spread over the
    whole run and none is always measured first (the host's slow patches last tens of
    seconds to minutes: docs/sim.md)."""
    order = []
    for k in range(repeats + 1):
        shift = k % len(layouts)
        order += [(k, name) for name in [*layouts[shift:], *layouts[:shift]]]
    return order


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
        routed_before: dict[str, float] = {}
        if args.per_level:
            if command[0] == "up":  # here the routes counted include the warm-ups'
                routed_before = proxy_routes(url)
            warm_up_each = (args.seed + WARM_UP_SEED, requests)
            client_cpu, windows = bench_levels(args, model, url, folder, stem, slo, warm_up_each)
            measured_from = windows["level_windows"][0][0]
        else:
            warm_up = (rates, folder / f"{stem}{WARM_UP}.json", args.seed + WARM_UP_SEED, slo, requests)
            client_cpu = [bench_run(args, model, url, *warm_up)]
            measured_from, windows = time.monotonic(), {}
            if command[0] == "up":
                routed_before = proxy_routes(url)
            measured = (rates, folder / f"{stem}.json", args.seed, slo, args.num_requests)
            client_cpu.append(bench_run(args, model, url, *measured))
        if command[0] == "up":  # how the proxy routed the measured run, and on what costs
            routed = {path: n - routed_before.get(path, 0.0) for path, n in proxy_routes(url).items()}
            workers = httpx.get(url + "/workers", timeout=30).json()
            proxy = {"routed": routed, "pd_costs": workers.get("pd_costs")}
        else:
            proxy = {}
    return {
        "stem": stem,
        "argv": argv[3:],
        "client_s_per_request": client_cpu_per_request(client_cpu),
        "measured_from": measured_from if args.step_log else None,
        **(windows if args.step_log else {}),
        **proxy,
    }


def bench_levels(
    args: argparse.Namespace,
    model: Path,
    url: str,
    folder: Path,
    stem: str,
    slo: str,
    warm_up: tuple[int, int],
) -> tuple[list[tuple[int, float]], dict[str, list[tuple[float, float]]]]:
    """`--per-level`: each rate's unmeasured run just before its measured one, so that the
    steps that fit the profile were logged beside the levels they predict, each at its
    own load, not minutes before them (the host's speed drifts over minutes: docs/sim.md;
    `predict` fits one profile on every level's warm-up, or each level on its own). The runs
    are merged into the layout's warm-up run and its measured run, one level each, and the
    clock windows of each are returned beside what the client spent (`bench_run`).
    `warm_up`: the warm-up runs' first seed and fewest requests a level; each sends at least
    `--warm-up-s` seconds of arrivals, so that a level near capacity has built its queue
    before it is fitted (60 requests at 16 req/s came to 4 s, and one such level came out
    59% short of its time to first token: docs/sim.md)."""
    warm_ups: list[dict] = []
    levels: list[dict] = []
    spent = [(0, 0.0), (0, 0.0)]
    windows: dict[str, list[tuple[float, float]]] = {"warm_up_windows": [], "level_windows": []}
    for k, rate in enumerate(args.rates):
        warm_up_sent = warm_up_requests(rate, warm_up[1], args.warm_up_s)
        runs = (
            ("warm_up_windows", WARM_UP, warm_up[0] + k, warm_up_sent, warm_ups),
            ("level_windows", "-level", args.seed + k, args.num_requests, levels),
        )
        for i, (kind, name, seed, requests, parts) in enumerate(runs):
            out = folder / f"{stem}{name}-{k}.json"
            start = time.monotonic()
            sent, cpu_s = bench_run(args, model, url, f"{rate:g}", out, seed, slo, requests)
            windows[kind].append((start, time.monotonic()))
            parts.append(json.loads(out.read_text()))
            spent[i] = (spent[i][0] + sent, spent[i][1] + cpu_s)
    (folder / f"{stem}{WARM_UP}.json").write_text(json.dumps(merged_run(warm_ups)))
    (folder / f"{stem}.json").write_text(json.dumps(merged_run(levels)))
    return spent, windows


def warm_up_requests(rate: float, fewest: int, seconds: float) -> int:
    return max(fewest, math.ceil(rate * seconds))


def merged_run(parts: Sequence[dict]) -> dict:
    """Bench runs of one level each as one run of their levels, in order, its DistServe
    goodput taken over all of them as `splitserve bench` takes it over its levels."""
    levels = [level for part in parts for level in part["levels"]]
    rates = [level["load"]["rate"] for level in levels]
    first = parts[0]
    goodput = {
        slo: distserve_goodput(
            rates, [level["summary"]["attainment"][slo] for level in levels], first["required_attainment"]
        )
        for slo in first["slos"]
    }
    return {**first, "levels": levels, "goodput_distserve": goodput}


class Fit(NamedTuple):
    """What a level of a layout is predicted from: the logged steps that re-time the
    profile and fit the waits, and the bench run whose requests fit the path (`source`
    says which run they are, for the printout)."""

    source: str
    records: list[StepRecord]
    run: dict | None


def in_windows(records: Sequence[StepRecord], windows: Sequence[Sequence[float]]) -> list[StepRecord]:
    return [r for r in records if any(start <= r.t < end for start, end in windows)]


def level_windows(measured: dict) -> tuple[list[Sequence[float]], list[Sequence[float]]]:
    """A layout's warm-up and measured clock windows: one each (a warm-up run, then the
    measured one), or one per level (`--per-level`)."""
    if "level_windows" in measured:
        return measured["warm_up_windows"], measured["level_windows"]
    start = measured["measured_from"]
    return [(-math.inf, start)], [(start, math.inf)]


def level_fits(
    measured: dict, logged: Sequence[StepRecord], warm_up_run: dict | None, run: dict, how: str
) -> list[Fit]:
    """One `Fit` per level of the measured run (the same object where levels share one).
    `how`: "warm-up" (every warm-up run's steps and requests), "per-level" (each level's
    own warm-up, where it was measured `--per-level`; else as "warm-up"), "measured" (the
    measured run's own, each level's where it was measured `--per-level`: a diagnostic of
    the model without the host's drift)."""
    warm, levels = level_windows(measured)
    count = len(run["levels"])
    rates = [f"{level['load']['rate']:g} req/s" for level in run["levels"]]
    if how == "measured" and len(levels) == count:  # measured level by level: each on itself
        return [
            Fit(f"its {rate} level itself (--fit-on-measured)", in_windows(logged, [w]), one_level(run, k))
            for k, (rate, w) in enumerate(zip(rates, levels, strict=True))
        ]
    if how == "measured":
        return [Fit("the measured run itself (--fit-on-measured)", in_windows(logged, levels), run)] * count
    if how == "per-level" and len(warm) == count and warm_up_run is not None:
        return [
            Fit(f"the unmeasured run just before {rate}", in_windows(logged, [w]), one_level(warm_up_run, k))
            for k, (rate, w) in enumerate(zip(rates, warm, strict=True))
        ]
    return [Fit("the unmeasured run before it", in_windows(logged, warm), warm_up_run)] * count


def one_level(run: dict, k: int) -> dict:
    return {**run, "levels": [run["levels"][k]]}


def planned_deployment(
    model_spec: ModelSpec, profile: EngineProfile, budget: int, name: str, cpus: Sequence[int], input_len: int
) -> Deployment:
    """Layout `name` as the planner sees it (sim/host_planner.py: the profile's steps on the
    layout's cores), its engines' scheduler as `up` starts them (its long-prefill threshold,
    not the engine's default), and `serve` as `serve_deployment` has it."""
    command, layout = layout_of(name, cpus)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=budget, long_prefill_token_threshold=UP_LONG_PREFILL_TOKEN_THRESHOLD
    )
    base = host_deployment(model_spec, profile, scheduler)
    dep = layout_deployment(base, layout, profile.threads or len(cpus), profile.measured_steps())
    return serve_deployment(dep, input_len) if command[0] == "serve" else dep


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
