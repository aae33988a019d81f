"""The calibrated simulator against `splitserve bench`: predict each load level of a saved
bench run (same arrival stream: bench and sim draw it from the same seed; each request's
own prompt and output lengths, as bench recorded them) and print every figure's prediction
next to its measurement: TTFT p50 and p90, ITL p50, p90 and p99, attainment of each SLO,
and the DistServe goodput; last, how many are within 10%. The peer is the real server,
measured in that bench run.

    splitserve sim calibrate --engine URL --render RENDER_URL --model DIR --gpu host.json \\
        --out profile.json
    splitserve bench --url URL --tokenizer DIR --rate 2,5,10 --num-requests 60 --json run.json
    python benchmarks/bench_sim_predicts_bench.py run.json DIR host.json --profile profile.json
    python benchmarks/bench_sim_predicts_bench.py up.json DIR host.json --profile profile.json --pd 1:1

One run, everything measured here (`--measure`): a profile is calibrated as
bench_plan_pick.py does (an `engine`, a `render` and a pinned `up --prefill 1 --decode 1`,
probed by `sim calibrate`), then `serve`, `up --prefill 0 --decode 1` (serve-like) and
`up --prefill 1 --decode 1` as the planner would start them are each measured by
`splitserve bench` at the given rates (one unmeasured run first), and each run is predicted
as the planner sees that layout (sim/host_planner.py: the profile's steps on the layout's
cores). With `--step-log` the engines log their steps, printed beside the simulator's per
role and by tokens a step. Everything measured stays in the folder printed (the profile,
the runs, the step logs, `measured.json`); `--replay FOLDER` predicts it again, with the
code as it is then, without measuring:

    python benchmarks/bench_sim_predicts_bench.py --measure [--model bench|smollm2|DIR] \
        [--rates 2 8 14] [--input-len 256] [--output-len 32] [--layouts serve "up 1P+1D"] [--step-log]
    python benchmarks/bench_sim_predicts_bench.py --replay /tmp/bench-sim-predicts-XXXX

`--profile` (a `sim calibrate --out` file): the fitted step times, the render tier's cost
per request and token, and (with `--pd`) the P/D decision on the profile's costs, as the
proxy's `--pd-decision cost`. `--fit` (a `sim calibrate --json` roofline fit) instead: the
roofline at the fitted efficiencies, nothing around the engine. The server is modelled as
`serve` runs (one collocated engine) or, with `--pd P:D`, as `up` runs (P prefill and D
decode engines, KV pushed layer by layer over the host's memory): splitserve's default
token budget, several prompts per step, least-loaded routing.
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
import numpy as np
from step_tables import step_rows, ttft_part_rows

from splitserve.config import UP_LONG_PREFILL_TOKEN_THRESHOLD, SchedulerConfig
from splitserve.engine.step_log import read_step_log
from splitserve.goodput import SLO, arrival_times, distserve_goodput
from splitserve.protocol.pd_decision import CostModel
from splitserve.sim import (
    Deployment,
    Efficiency,
    InstanceConfig,
    KVLink,
    Workload,
    load_gpu,
    load_model,
    simulate,
)
from splitserve.sim.host_planner import HostLayout
from splitserve.sim.metrics import met
from splitserve.sim.profile import load_profile
from splitserve.sim.result import SimResult


def deployment(args: argparse.Namespace) -> Deployment:
    sched = InstanceConfig(SchedulerConfig(max_num_batched_tokens=args.budget))
    dep = Deployment(
        load_model(args.model),
        load_gpu(args.gpu),
        replicas=args.replicas,
        sched=sched,
        prefill_sched=sched,
        routing="least_loaded",
    )
    if args.profile:
        profile = load_profile(args.profile)
        dep = replace(dep, steps=profile.steps, cpu=profile.cpu, pd_costs=profile.decision_costs())
    else:
        with open(args.fit) as f:
            fit = json.load(f)
        keys = ("compute", "bandwidth", "overhead_s", "attention", "per_seq_overhead_s")
        eff = Efficiency(
            **{k: fit[k] for k in keys},
            small_chunk_tokens=fit["small_chunk_tokens"],
            kv_bandwidth=fit["kv_bandwidth"],
        )
        dep = replace(dep, eff=eff)
    if args.pd:
        prefills, decodes = (int(x) for x in args.pd.split(":"))
        link = KVLink(
            gbps=dep.gpu.mem_bw * 8 / 1e9
        )  # KV moves through shared memory: the host's copy bandwidth
        dep = replace(dep, mode="pd", prefill_instances=prefills, decode_instances=decodes, link=link)
    return dep


def workload_of(level: dict) -> Workload:
    """The level's arrivals (bench's seeded stream) with each request's recorded lengths."""
    load, reqs = level["load"], sorted(level["requests"], key=lambda r: r["request_id"])
    n = len(reqs)
    arrival = arrival_times(
        load["rate"], n, load["seed"], load.get("arrival", "poisson"), load.get("burstiness", 1.0)
    )
    mean_in = round(float(np.mean([r["input_tokens"] for r in reqs if r["input_tokens"]])))
    prompts = [r["input_tokens"] or mean_in for r in reqs]
    outputs = [max(1, r["output_tokens"] or 1) for r in reqs]
    return Workload.open_loop(arrival, prompts, outputs)


# the figures issue 27's must-hold names (the rest are printed, and counted apart)
MUST_HOLD = ("TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "goodput")


def compare(
    run: dict, dep: Deployment, results: list[SimResult] | None = None
) -> tuple[list[str], dict[str, float]]:
    """Each level of a saved bench run predicted by simulating `dep` on its arrivals: one
    printable row per figure, and the relative error of every figure measured non-zero,
    by "rate figure". `results`, when given, gets each level's simulation."""
    slos = [SLO.parse(s) for s in run["slos"]]
    rows: list[str] = []
    errors: dict[str, float] = {}
    att_pred: dict[str, list[float]] = {s.name: [] for s in slos}
    for level in run["levels"]:
        load = level["load"]
        r = simulate(dep, workload_of(level))
        if results is not None:
            results.append(r)
        keep = np.arange(len(r.ttft)) >= load["warmup"]
        itl = np.concatenate([g for g, k in zip(r.gaps, keep, strict=True) if k and len(g)])
        ttft, s = r.ttft[keep], level["summary"]
        pairs = {
            "TTFT p50 ms": (float(np.percentile(ttft, 50)) * 1e3, s["ttft"]["p50"] * 1e3),
            "TTFT p90 ms": (float(np.percentile(ttft, 90)) * 1e3, s["ttft"]["p90"] * 1e3),
            "ITL p50 ms": (float(np.percentile(itl, 50)) * 1e3, s["itl"]["p50"] * 1e3),
            "ITL p90 ms": (float(np.percentile(itl, 90)) * 1e3, s["itl"]["p90"] * 1e3),
            "ITL p99 ms": (float(np.percentile(itl, 99)) * 1e3, s["itl"]["p99"] * 1e3),
        }
        for slo in slos:
            a = float(met(slo, r)[keep].mean())
            att_pred[slo.name].append(a)
            pairs[f"attainment {slo.name} %"] = (a * 100, s["attainment"][slo.name] * 100)
        for name, (pred, meas) in pairs.items():
            err = pred / meas - 1 if meas else float("nan")
            if meas:
                errors[f"{load['rate']:g} {name}"] = abs(err)
            rows.append(
                f"{load['rate']:>6g} req/s  {name:36s} sim {pred:9.1f}  bench {meas:9.1f}  {err:+7.1%}"
            )
    rates = [lv["load"]["rate"] for lv in run["levels"]]
    for slo in slos:
        pred = distserve_goodput(rates, att_pred[slo.name], run["required_attainment"])
        meas = run["goodput_distserve"][slo.name]
        if meas:
            errors[f"goodput {slo.name}"] = abs(pred / meas - 1)
        rows.append(f"goodput {slo.name:28s} sim {pred:g} req/s  bench {meas:g} req/s")
    return rows, errors


def print_verdict(errors: dict[str, float]) -> None:
    named = {k: e for k, e in errors.items() if any(f in k for f in MUST_HOLD)}
    for label, chosen in (("every figure", errors), ("the must-hold's (TTFT, ITL p50/p90, goodput)", named)):
        values = list(chosen.values())
        within = sum(e <= 0.10 for e in values)
        median = np.median(values) if values else float("nan")
        print(f"{label}: within 10% (measured non-zero) {within}/{len(values)}; median |error| {median:.1%}")


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


def serve_deployment(dep: Deployment, prompt_tokens: int) -> Deployment:
    """`serve` as the profile sees it: one process, its engine's own scheduler (no
    long-prefill cap), and no proxy or render tier. Its OpenAI API is its own CPU: the
    engine API's (measured on `up`'s one-thread decode engine) and the tokenizing the render
    tier measured, also a delay before the engine sees the prompt; its detokenizing is not
    measured apart (in `up` it is part of the tiers' CPU per token) and counts nothing."""
    uncapped = replace(dep.sched.scheduler, long_prefill_token_threshold=0)
    dep = replace(dep, sched=replace(dep.sched, scheduler=uncapped))
    if dep.cpu is None:
        return dep
    c = dep.cpu
    tokenize = c.render_s_per_request + c.render_s_per_token * prompt_tokens
    cpu = replace(
        c,
        proxy_s_per_request=0.0,
        cpu_s_per_request=0.0,
        cpu_s_per_remote_request=0.0,
        cpu_s_per_step=0.0,
        cpu_s_per_token=0.0,
        engine_s_per_request=c.engine_s_per_request + tokenize,
    )
    return replace(dep, cpu=cpu)


def with_client_cpu(dep: Deployment, client_s_per_token: float) -> Deployment:
    """The bench client's CPU, which it spends reading each streamed token, charged as the
    simulator charges the tiers' CPU per streamed token, but at a second of each busy
    engine's time per second of it, not the tiers' share of the cores (`cpu_loss`): one
    process, on one core at a time, which stops whichever engine it lands beside. (Charged
    per request, at each arrival, the simulated prompt steps came out 20 ms longer than the
    engines logged them while their decode steps came out shorter; in four runs per token
    predicted `serve` and 1P+1D closer in every one: docs/sim.md.)"""
    if dep.cpu is None or client_s_per_token <= 0:
        return dep
    per_token = dep.cpu.cpu_s_per_token + client_s_per_token / dep.cpu_loss
    return replace(dep, cpu=replace(dep.cpu, cpu_s_per_token=per_token))


LAYOUTS = ("serve", "up serve-like", "up 1P+1D")
MEASURED = "measured.json"  # what --measure saved beside the profile and the runs, for --replay


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
    }[name]


def proxy_routes(url: str) -> dict[str, float]:
    """The proxy's requests so far by path (decode_only, pd_push, pd_pull), from its /metrics."""
    found: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'^splitserve_proxy_requests_total\{path="(\w+)"\}\s+(\S+)$', line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def remote_share(results: list[SimResult]) -> float:
    remote = np.concatenate([r.remote for r in results if r.remote is not None] or [np.zeros(0)])
    return float(remote.mean()) if len(remote) else 0.0


def measure(args: argparse.Namespace) -> Path:
    """Calibrate, then measure each layout with `splitserve bench` (an unmeasured run
    first); returns the folder holding the profile, the runs and what `predict` needs."""
    from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model
    from bench_plan_pick import WARM_UP_SEED, calibrate, splitserve
    from bench_render import free_port, served

    model, dtype = resolve_bench_model(args.model), compute_dtype()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"model {model}; ISA {cpu_isa_flags()}; dtype {dtype}; CPUs {cpus}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-sim-predicts-"))
    calibrate(args, model, dtype, folder / "profile.json")
    flags = ["--dtype", dtype, "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    slo = f"ttft={args.slo_ttft_ms}ms,gap={args.slo_gap_ms}ms"
    saved: dict = {"model": str(model), "dtype": dtype, "isa": cpu_isa_flags(), "cpus": cpus}
    saved |= {"budget": args.budget, "input_len": args.input_len, "layouts": {}}
    for name in args.layouts:
        command, layout = layout_of(name, cpus)
        port = free_port()
        argv = splitserve(command[0], str(model), *command[1:], "--port", str(port), *flags)
        for entry in layout.cpu_affinity(cpus):
            argv += ["--cpu-affinity", entry]
        stem = name.replace(" ", "-")
        if args.step_log:
            argv += ["--step-log", str(folder / f"{stem}-steps.jsonl")]
        measured_from = 0.0  # when the measured run began, on the step log's clock
        with served(argv, port, name) as url:
            # first an unmeasured run (a fresh stack's first burst builds its kernels per batch
            # shape) with prompts of its own: one the measured run sent again would be a
            # prefix-cache hit there
            warm_up = (f"{max(args.rates):g}", folder / "warm-up.json", args.seed + WARM_UP_SEED)
            measured = (",".join(f"{r:g}" for r in args.rates), folder / f"{stem}.json", args.seed)
            client_cpu: list[tuple[int, float]] = []  # (requests sent, CPU seconds) per bench run
            routed_before: dict[str, float] = {}
            for rates, out, seed in (warm_up, measured):
                measured_from = time.monotonic()
                routed_before = proxy_routes(url) if command[0] == "up" else {}
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                bench = splitserve(
                    "bench", "--url", url, "--tokenizer", str(model), "--endpoint", "completions",
                    "--rate", rates, "--num-requests", str(args.num_requests), "--warmup", str(args.warmup),
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--slo", slo,
                    "--attainment", str(args.target), "--seed", str(seed), "--json", str(out), "--quiet",
                )  # fmt: skip
                subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                sent = sum(len(level["requests"]) for level in json.loads(out.read_text())["levels"])
                client_cpu.append((sent, cpu_s))
            if command[0] == "up":  # how the proxy routed the measured run, and on what costs
                routed = {path: n - routed_before.get(path, 0.0) for path, n in proxy_routes(url).items()}
                workers = httpx.get(url + "/workers", timeout=30).json()
                proxy = {"routed": routed, "pd_costs": workers.get("pd_costs")}
            else:
                proxy = {}
        saved["layouts"][name] = {
            "argv": argv[3:],
            "client_s_per_request": client_cpu_per_request(client_cpu),
            "measured_from": measured_from if args.step_log else None,
            **proxy,
        }
        (folder / MEASURED).write_text(json.dumps(saved, indent=1))
    print(f"measured: {folder} (--replay {folder} predicts it again)", flush=True)
    return folder


def predict(folder: Path) -> None:
    """Each layout `measure` saved in `folder`, predicted as the planner sees it (the
    profile's steps on the layout's cores) and set beside its measured run, figure by
    figure and, where the engines logged their steps, step by step."""
    from splitserve.sim.host_planner import host_deployment, layout_deployment
    from splitserve.sim.specs import load_model as load_model_spec

    saved = json.loads((folder / MEASURED).read_text())
    profile = load_profile(str(folder / "profile.json"))
    # the engines as `up` starts them (its long-prefill threshold, not the engine's default)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=saved["budget"], long_prefill_token_threshold=UP_LONG_PREFILL_TOKEN_THRESHOLD
    )
    base = host_deployment(load_model_spec(saved["model"]), profile, scheduler)
    all_errors: dict[str, float] = {}
    for name, measured in saved["layouts"].items():
        stem = name.replace(" ", "-")
        command, layout = layout_of(name, saved["cpus"])
        run = json.loads((folder / f"{stem}.json").read_text())
        client_s = measured["client_s_per_request"]
        print(f"\n{name}: the bench client spent {client_s * 1e3:.1f} ms of CPU per request", flush=True)
        dep = layout_deployment(base, layout, profile.threads or len(saved["cpus"]), profile.measured_steps())
        if command[0] == "serve":
            dep = serve_deployment(dep, saved["input_len"])
        streamed = [q["output_tokens"] for lv in run["levels"] for q in lv["requests"] if q["output_tokens"]]
        dep = with_client_cpu(dep, client_s / float(np.mean(streamed)) if streamed else 0.0)
        results: list[SimResult] = []
        rows, errors = compare(run, dep, results)
        print(f"\n{name} ({' '.join(measured['argv'])})")
        print("\n".join(rows))
        print(f"\n{name}: the time to first token by the server's phases")
        print("\n".join(ttft_part_rows(run, results)))
        if measured["measured_from"] is not None:
            step_log = folder / f"{stem}-steps.jsonl"
            real = [r for r in read_step_log(step_log) if r.t > measured["measured_from"]]
            simulated = [(role, trace) for r in results for role, trace in zip(r.roles, r.steps, strict=True)]
            print(f"\n{name}: the engines' steps in the measured run ({step_log}) and the simulator's")
            print("\n".join(step_rows(real, simulated)))
        print_verdict(errors)
        routed = measured.get("routed")
        if routed and dep.mode == "pd":
            real_share = routed.get("pd_push", 0.0) / max(1.0, sum(routed.values()))
            print(f"prompts prefilled on a prefill worker: the proxy {real_share:.0%}, the simulator "
                  f"{remote_share(results):.0%}")  # fmt: skip
            pd = measured.get("pd_costs") or {}
            if pd.get("costs"):
                own_results: list[SimResult] = []
                _, own_errors = compare(run, replace(dep, pd_costs=CostModel(**pd["costs"])), own_results)
                print(f"with the proxy's own costs ({pd['costs']}): the simulator "
                      f"{remote_share(own_results):.0%} remote")  # fmt: skip
                print_verdict(own_errors)
        all_errors.update({f"{name} {k}": e for k, e in errors.items()})
    machine = f"{saved['dtype']}, ISA {saved['isa']}, {len(saved['cpus'])} CPUs"
    print(f"\nmodel {Path(saved['model']).name}, {machine}; every layout:")
    print_verdict(all_errors)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bench_json", nargs="?")
    p.add_argument("model", nargs="?")
    p.add_argument("gpu", nargs="?")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--profile", help="a `sim calibrate --engine URL --out FILE` profile")
    how.add_argument("--fit", help="a `sim calibrate --json` roofline fit")
    how.add_argument("--measure", action="store_true", help="calibrate, measure serve and up, predict both")
    how.add_argument(
        "--replay", metavar="FOLDER", help="predict again what an earlier --measure saved in FOLDER"
    )
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--budget", type=int, default=SchedulerConfig().max_num_batched_tokens)
    p.add_argument("--pd", default=None, metavar="P:D", help="model `splitserve up` with P prefill, D decode")
    m = p.add_argument_group("--measure")
    m.add_argument(
        "--model", dest="bench_model", default="bench", help="bench, smollm2, or a model directory"
    )
    m.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 14.0])
    m.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    m.add_argument("--input-len", type=int, default=256)
    m.add_argument("--output-len", type=int, default=32)
    m.add_argument("--slo-ttft-ms", type=int, default=500)
    m.add_argument("--slo-gap-ms", type=int, default=100)
    m.add_argument("--target", type=float, default=0.9)
    m.add_argument("--num-requests", type=int, default=60)
    m.add_argument("--warmup", type=int, default=4)
    m.add_argument("--max-model-len", type=int, default=4096)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--step-log", action="store_true", help="log the engines' steps and print them beside the simulator's"
    )
    args = p.parse_args()
    if args.measure:
        args.model = args.bench_model
        predict(measure(args))
        return
    if args.replay:
        predict(Path(args.replay))
        return
    if not (args.bench_json and args.model and args.gpu and (args.profile or args.fit)):
        p.error("give BENCH_JSON MODEL GPU with --profile or --fit, or --measure")
    with open(args.bench_json) as f:
        run = json.load(f)
    rows, errors = compare(run, deployment(args))
    print("\n".join(rows))
    print_verdict(errors)


if __name__ == "__main__":
    main()
