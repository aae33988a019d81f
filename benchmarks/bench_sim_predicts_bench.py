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

One run, everything measured here (`--measure`, benchmarks/sim_predicts_measure.py): a
profile is calibrated as bench_plan_pick.py does, then `serve`, `up --prefill 0 --decode 1`
(serve-like), `up --prefill 1 --decode 1` and `up --prefill 0 --decode 2` (two collocated
engines, one a core) as the planner would start them are each
measured by `splitserve bench` at the given rates (one unmeasured run first; with
`--repeat`, each layout is started and measured a second time: the noise floor), and each
run is predicted as the planner sees that layout (sim/host_planner.py: the profile's steps
on the layout's cores). With `--step-log` the engines log their steps, printed beside the
simulator's per role and by tokens a step, and each layout is predicted with the profile
re-timed by its own engines' steps in the unmeasured run before its measurement (`sim
retime --waits`, sim/retime.py: the same engines' speed now, not the probe engines' minutes
before, and what their steps waited for a core, sim/step_waits.py; `--placed-cpu` re-times
the speed only and lets the simulator place the tiers' CPU itself; `--as-calibrated`
predicts with the profile as calibrated; `--fit-on-measured`, a diagnostic, fits each layout on
its measured run itself, which leaves the model's error without the host's drift between
runs). With `--per-level` each rate's unmeasured run comes just before its measured one,
and each level is predicted from the steps and requests of its own (the host's speed
drifts over the minutes between one sweep and the next, and an engine's speed depends on
its load; `--replay --one-profile` fits one profile on every level's instead). Everything measured
stays in the folder printed; `--replay FOLDER` predicts it again, with the code as it is
then, without measuring:

    python benchmarks/bench_sim_predicts_bench.py --measure [--model bench|smollm2|DIR] \
        [--rates 2 8 14] [--input-len 256] [--output-len 32] [--layouts serve "up 1P+1D"] \
        [--step-log] [--per-level [--warm-up-s 10]] [--repeat]
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
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from sim_predicts_measure import (
    LAYOUTS,
    MEASURED,
    REPEAT,
    WARM_UP,
    Fit,
    in_windows,
    level_fits,
    level_windows,
    measure,
    planned_deployment,
    with_client_cpu,
)
from step_tables import step_rows, ttft_part_rows

from splitserve.config import SchedulerConfig
from splitserve.goodput import SLO, arrival_times, distserve_goodput
from splitserve.protocol.pd_decision import CostModel
from splitserve.protocol.step_record import read_step_log
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
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.metrics import met
from splitserve.sim.path_latency import fit_path_latency, path_row
from splitserve.sim.profile import EngineProfile, load_profile
from splitserve.sim.result import SimResult
from splitserve.sim.retime import factor_rows, retime_profile
from splitserve.sim.step_waits import wait_rows


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
    """The level's arrivals (bench's seeded stream) with each request's recorded lengths.
    bench sends its first request at once and each next one a gap later (bench/load.py),
    where `arrival_times` puts the first after one gap."""
    load, reqs = level["load"], sorted(level["requests"], key=lambda r: r["request_id"])
    n = len(reqs)
    stream = (load["rate"], n - 1, load["seed"], load.get("arrival", "poisson"), load.get("burstiness", 1.0))
    arrival = [0.0, *arrival_times(*stream)]
    mean_in = round(float(np.mean([r["input_tokens"] for r in reqs if r["input_tokens"]])))
    prompts = [r["input_tokens"] or mean_in for r in reqs]
    outputs = [max(1, r["output_tokens"] or 1) for r in reqs]
    return Workload.open_loop(arrival, prompts, outputs)


# each level is simulated this many times, with different draws of the steps' spread, of the
# tokens' relay and of random routing, and its figures taken over every run's requests: at
# the same arrivals, one run's TTFT p90 moved by up to 27 points from one seed to the next
# (docs/sim.md)
SIM_RUNS = 16

# the figures issue 27's must-hold names (the rest are printed, and counted apart)
MUST_HOLD = ("TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "goodput")


def level_figures(summary: dict, slo_names: Sequence[str]) -> dict[str, float]:
    """A bench level's figures by name: TTFT and ITL in ms, attainment of each SLO in %."""
    ms = {
        f"{metric.upper()} {q} ms": summary[metric][q] * 1e3
        for metric in ("ttft", "itl")
        for q in ("p50", "p90")
    }
    ms["ITL p99 ms"] = summary["itl"]["p99"] * 1e3
    return ms | {f"attainment {name} %": summary["attainment"][name] * 100 for name in slo_names}


def measured_figures(run: dict) -> dict[str, float]:
    """A saved bench run's figures, by "rate figure" and "goodput slo"."""
    names = [SLO.parse(s).name for s in run["slos"]]
    found = {
        f"{level['load']['rate']:g} {name}": value
        for level in run["levels"]
        for name, value in level_figures(level["summary"], names).items()
    }
    return found | {f"goodput {name}": run["goodput_distserve"][name] for name in names}


def relative_errors(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """|predicted / measured - 1| of every figure measured non-zero."""
    return {k: abs(predicted[k] / m - 1) for k, m in measured.items() if m}


def compare(
    run: dict, deps: Sequence[Deployment], results: list[SimResult] | None = None
) -> tuple[list[str], dict[str, float]]:
    """Each level of a saved bench run predicted by simulating its deployment (`deps`, one
    per level) on its arrivals: one printable row per figure, and the relative error of
    every figure measured non-zero, by "rate figure". `results`, when given, gets the
    first of each level's simulations."""
    slos = [SLO.parse(s) for s in run["slos"]]
    predicted: dict[str, float] = {}
    att_pred: dict[str, list[float]] = {s.name: [] for s in slos}
    for level, dep in zip(run["levels"], deps, strict=True):
        workload = workload_of(level)
        runs = [simulate(dep, workload, seed) for seed in range(SIM_RUNS)]
        if results is not None:
            results.append(runs[0])
        keep = np.arange(len(workload)) >= level["load"]["warmup"]
        itl = np.concatenate([g for r in runs for g, k in zip(r.gaps, keep, strict=True) if k and len(g)])
        ttft = np.concatenate([r.ttft[keep] for r in runs])
        attained = {s.name: float(np.mean([met(s, r)[keep].mean() for r in runs])) for s in slos}
        summary = {
            "ttft": {"p50": np.percentile(ttft, 50), "p90": np.percentile(ttft, 90)},
            "itl": {q: np.percentile(itl, int(q[1:])) for q in ("p50", "p90", "p99")},
            "attainment": attained,
        }
        for name, value in level_figures(summary, list(attained)).items():
            predicted[f"{level['load']['rate']:g} {name}"] = float(value)
        for name, a in attained.items():
            att_pred[name].append(a)
    rates = [lv["load"]["rate"] for lv in run["levels"]]
    for slo in slos:
        predicted[f"goodput {slo.name}"] = distserve_goodput(
            rates, att_pred[slo.name], run["required_attainment"]
        )
    measured = measured_figures(run)
    rows = []
    for key, meas in measured.items():
        pred = predicted[key]
        if key.startswith("goodput "):
            rows.append(f"{key:36s} sim {pred:g} req/s  bench {meas:g} req/s")
        else:
            rate, name = key.split(" ", 1)
            err = f"{pred / meas - 1:+7.1%}" if meas else "      -"
            rows.append(f"{rate:>6s} req/s  {name:36s} sim {pred:9.1f}  bench {meas:9.1f}  {err}")
    return rows, relative_errors(predicted, measured)


def print_verdict(errors: dict[str, float]) -> None:
    named = {k: e for k, e in errors.items() if any(f in k for f in MUST_HOLD)}
    for label, chosen in (("every figure", errors), ("the must-hold's (TTFT, ITL p50/p90, goodput)", named)):
        values = list(chosen.values())
        within = sum(e <= 0.10 for e in values)
        median = np.median(values) if values else float("nan")
        print(f"{label}: within 10% (measured non-zero) {within}/{len(values)}; median |error| {median:.1%}")


def remote_share(results: list[SimResult]) -> float:
    remote = np.concatenate([r.remote for r in results if r.remote is not None] or [np.zeros(0)])
    return float(remote.mean()) if len(remote) else 0.0


def layout_profile(profile: EngineProfile, name: str, fit: Fit, waits: bool = True) -> EngineProfile:
    """`profile` re-timed by the layout's engines' own steps in `fit` (the unmeasured run
    that warmed it up, or the one just before a level), where they logged them with their
    shapes; with `waits`, what those steps waited for a core fitted too
    (sim/step_waits.py), and the path around the engines and the tokens' relay from the
    fit's run's requests (sim/path_latency.py)."""
    try:
        retimed, factors = retime_profile(profile, fit.records, waits=waits)
    except CalibrationError as exc:
        print(f"{name}: the profile as calibrated ({exc})", flush=True)
        return profile
    print(f"{name}: the profile re-timed by its engines' steps in {fit.source}")
    print("\n".join("  " + row for row in factor_rows(factors)), flush=True)
    if retimed.waits is not None:
        print("\n".join("  " + row for row in wait_rows(retimed.waits)), flush=True)
    if waits and fit.run is not None:
        try:
            retimed = replace(retimed, path=fit_path_latency(fit.run))
            print("  " + path_row(retimed.path), flush=True)
        except ValueError as exc:
            print(f"  the path around the engines as calibrated ({exc})", flush=True)
    return retimed


def predict(folder: Path, as_calibrated: bool = False, waits: bool = True, how: str = "per-level") -> None:
    """Each layout `measure` saved in `folder`, predicted as the planner sees it (the
    profile's steps on the layout's cores; re-timed by its engines' warm-up steps, where
    they were logged, unless `as_calibrated`; `how` says which: `level_fits`) and set
    beside its measured run, figure by figure and, where the engines logged their steps,
    step by step."""
    from splitserve.sim.specs import load_model as load_model_spec

    saved = json.loads((folder / MEASURED).read_text())
    profile = load_profile(str(folder / "profile.json"))
    model_spec = load_model_spec(saved["model"])
    all_errors: dict[str, float] = {}
    repeat_errors: dict[str, float] = {}
    for name, measured in saved["layouts"].items():
        stem = name.replace(" ", "-")
        run = json.loads((folder / f"{stem}.json").read_text())
        client_s = measured["client_s_per_request"]
        print(f"\n{name}: the bench client spent {client_s * 1e3:.1f} ms of CPU per request", flush=True)
        step_log = folder / f"{stem}-steps.jsonl"
        logged = read_step_log(step_log) if measured["measured_from"] is not None else []
        profiles = [profile] * len(run["levels"])
        if logged and not as_calibrated:
            warm_up = folder / f"{stem}{WARM_UP}.json"
            warm_up_run = json.loads(warm_up.read_text()) if warm_up.exists() else None
            fits = level_fits(measured, logged, warm_up_run, run, how)
            unique = {id(fit): fit for fit in fits}  # levels that share a fit share its profile
            fitted = {key: layout_profile(profile, name, fit, waits) for key, fit in unique.items()}
            profiles = [fitted[id(fit)] for fit in fits]
        streamed = [q["output_tokens"] for lv in run["levels"] for q in lv["requests"] if q["output_tokens"]]
        deps = []
        for mine in profiles:
            dep = planned_deployment(
                model_spec, mine, saved["budget"], name, saved["cpus"], saved["input_len"]
            )
            deps.append(with_client_cpu(dep, client_s / float(np.mean(streamed)) if streamed else 0.0))
        results: list[SimResult] = []
        rows, errors = compare(run, deps, results)
        print(f"\n{name} ({' '.join(measured['argv'])})")
        print("\n".join(rows))
        print(f"\n{name}: the time to first token by the server's phases")
        print("\n".join(ttft_part_rows(run, results)))
        if measured["measured_from"] is not None:
            real = in_windows(logged, level_windows(measured)[1])
            simulated = [(role, trace) for r in results for role, trace in zip(r.roles, r.steps, strict=True)]
            print(f"\n{name}: the engines' steps in the measured run ({step_log}) and the simulator's")
            print("\n".join(step_rows(real, simulated)))
        print_verdict(errors)
        routed = measured.get("routed")
        if routed and deps[0].mode == "pd":
            real_share = routed.get("pd_push", 0.0) / max(1.0, sum(routed.values()))
            print(f"prompts prefilled on a prefill worker: the proxy {real_share:.0%}, the simulator "
                  f"{remote_share(results):.0%}")  # fmt: skip
            pd = measured.get("pd_costs") or {}
            if pd.get("costs"):
                own_results: list[SimResult] = []
                own = [replace(dep, pd_costs=CostModel(**pd["costs"])) for dep in deps]
                _, own_errors = compare(run, own, own_results)
                print(f"with the proxy's own costs ({pd['costs']}): the simulator "
                      f"{remote_share(own_results):.0%} remote")  # fmt: skip
                print_verdict(own_errors)
        all_errors.update({f"{name} {k}": e for k, e in errors.items()})
        if name in saved.get("repeats", {}):
            again = measured_figures(json.loads((folder / f"{stem}{REPEAT}.json").read_text()))
            first = measured_figures(run)
            print(f"\n{name} measured again, from a fresh start: the figures that moved more than 10%")
            for key, value in first.items():
                moved = again[key] / value - 1 if value else 0.0
                if abs(moved) > 0.10:
                    print(f"{key:48s} first {value:9.1f}  again {again[key]:9.1f}  {moved:+7.1%}")
            errors = relative_errors(again, first)
            print_verdict(errors)
            repeat_errors.update({f"{name} {k}": e for k, e in errors.items()})
    machine = f"{saved['dtype']}, ISA {saved['isa']}, {len(saved['cpus'])} CPUs"
    print(f"\nmodel {Path(saved['model']).name}, {machine}; every layout:")
    print_verdict(all_errors)
    if repeat_errors:
        print("every layout measured again, from a fresh start, against its first run (the noise floor):")
        print_verdict(repeat_errors)


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
    m.add_argument(
        "--repeat", action="store_true", help="measure each layout again, on a fresh start: the noise floor"
    )
    m.add_argument(
        "--per-level",
        action="store_true",
        help="each level's unmeasured run just before it (and each level predicted from its own), "
        "not one unmeasured run of every level before the measured one",
    )
    m.add_argument(
        "--warm-up-s",
        type=float,
        default=10.0,
        help="with --per-level: each level's unmeasured run sends this many seconds of arrivals, or more",
    )
    p.add_argument(
        "--as-calibrated",
        action="store_true",
        help="with --measure or --replay: predict with the profile as calibrated, not re-timed by "
        "each layout's logged warm-up steps",
    )
    p.add_argument(
        "--placed-cpu",
        action="store_true",
        help="with --measure or --replay: the simulator places the tiers' CPU on the engines' cores by "
        "its rules, instead of the waits fitted from each layout's logged warm-up steps",
    )
    p.add_argument(
        "--fit-on-measured",
        action="store_true",
        help="with --replay, a diagnostic: re-time and fit each layout on its measured run's own "
        "steps and requests (each level its own, where measured --per-level), not the run "
        "before it; what is then left is the model's error, not the host's drift between two runs",
    )
    p.add_argument(
        "--one-profile",
        action="store_true",
        help="with --replay of a --per-level run: one profile fitted on every level's warm-up, "
        "not each level on its own",
    )
    args = p.parse_args()
    how = "measured" if args.fit_on_measured else "warm-up" if args.one_profile else "per-level"
    if args.measure:
        args.model = args.bench_model
        predict(measure(args), args.as_calibrated, not args.placed_cpu, how)
        return
    if args.replay:
        predict(Path(args.replay), args.as_calibrated, not args.placed_cpu, how)
        return
    if not (args.bench_json and args.model and args.gpu and (args.profile or args.fit)):
        p.error("give BENCH_JSON MODEL GPU with --profile or --fit, or --measure")
    with open(args.bench_json) as f:
        run = json.load(f)
    rows, errors = compare(run, [deployment(args)] * len(run["levels"]))
    print("\n".join(rows))
    print_verdict(errors)


if __name__ == "__main__":
    main()
