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
`--repeat N`, each layout is started and measured N times more, in rounds spread over the
run: each figure's median over the rounds is predicted, and each round against the median
of the others is the noise floor), and each
run is predicted as the planner sees that layout (sim/host_planner.py: the profile's steps
on the layout's cores). With `--step-log` the engines log their steps, printed beside the
simulator's per role and by tokens a step, and each layout is predicted with the profile
re-timed by its own engines' steps in the unmeasured run before its measurement (`sim
retime --waits`, sim/retime.py: the same engines' speed now, not the probe engines' minutes
before, and what their steps waited for a core, sim/step_waits.py; `--placed-cpu` re-times
the speed only and lets the simulator place the tiers' CPU itself; `--as-calibrated`
predicts with the profile as calibrated; `--fit-on-measured`, a diagnostic, fits each layout on
its measured run itself, which leaves the model's error without the host's drift between
runs). With `--per-level` each rate's unmeasured run comes just before its measured one
(the host's speed drifts over the minutes between one sweep and the next, and an
engine's speed depends on its load), and one profile is fitted on the steps and requests
of every level's (`--each-level`: each level on its own). Everything measured
stays in the folder printed; `--replay FOLDER` predicts it again, with the code as it is
then, without measuring:

    python benchmarks/bench_sim_predicts_bench.py --measure [--model bench|smollm2|DIR] \
        [--rates 2 8 14] [--input-len 256] [--output-len 32] [--layouts serve "up 1P+1D"] \
        [--step-log] [--per-level [--warm-up-s 10]] [--repeat [N]]
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
from typing import NamedTuple

import numpy as np
from sim_predicts_figures import (
    compare,
    figure_rows,
    measured_figures,
    median_figures,
    predicted_figures,
    print_verdict,
    relative_errors,
)
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
from splitserve.protocol.pd_decision import CostModel
from splitserve.protocol.step_record import StepRecord, read_step_log
from splitserve.sim import Deployment, Efficiency, InstanceConfig, KVLink, load_gpu, load_model
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.path_latency import fit_path_latency, path_row
from splitserve.sim.profile import EngineProfile, load_profile
from splitserve.sim.result import SimResult
from splitserve.sim.retime import factor_rows, retime_profile
from splitserve.sim.specs import ModelSpec
from splitserve.sim.specs import load_model as load_spec
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


class FitChoice(NamedTuple):
    """What each layout is predicted with: the profile `as_calibrated`, or re-timed by its
    engines' logged steps (`level_fits` says which steps, by `how`), with the `waits` for
    a core, path and relay fitted too. One profile on every warm-up of a round by default:
    over eight runs on two hosts it held 182 must-hold figures where each level from its
    own warm-up held 158 (docs/sim.md)."""

    as_calibrated: bool = False
    waits: bool = True
    how: str = "warm-up"


def predict(folder: Path, choice: FitChoice = FitChoice()) -> None:
    """Each layout `measure` saved in `folder`, predicted as the planner sees it
    (`predict_round`) and set beside its measured run; where it was measured in several
    rounds (`--repeat`), the median of the rounds' predictions beside the median of their
    measurements, and each round against the median of the others (the noise floor)."""
    saved = json.loads((folder / MEASURED).read_text())
    profile = load_profile(str(folder / "profile.json"))
    model_spec = load_spec(saved["model"])
    all_errors: dict[str, float] = {}
    repeat_errors: dict[str, float] = {}
    for name in saved["layouts"]:
        rounds = layout_rounds(saved, name)
        figures = [
            predict_round(folder, saved, profile, model_spec, name, measured, choice) for measured in rounds
        ]
        predicted, real = median_figures([p for p, _ in figures]), median_figures([m for _, m in figures])
        errors = relative_errors(predicted, real)
        if len(rounds) > 1:
            print(f"\n{name}: the median of its {len(rounds)} rounds, predicted and measured")
            print("\n".join(figure_rows(predicted, real)))
            print_verdict(errors)
            noise = noise_floor([m for _, m in figures])
            repeat_errors.update({f"{name} {key}": e for key, e in noise.items()})
        all_errors.update({f"{name} {k}": e for k, e in errors.items()})
    machine = f"{saved['dtype']}, ISA {saved['isa']}, {len(saved['cpus'])} CPUs"
    print(f"\nmodel {Path(saved['model']).name}, {machine}; every layout:")
    print_verdict(all_errors)
    if repeat_errors:
        print("each round of every layout against the median of its others (the noise floor):")
        print_verdict(repeat_errors)


def layout_rounds(saved: dict, name: str) -> list[dict]:
    """Layout `name`'s measurements in `saved`, its first round first. A folder measured
    before rounds (the seventeenth session) named no stems and held one repeat at most."""
    stem = name.replace(" ", "-")
    again = saved.get("repeats", {}).get(name, [])
    if isinstance(again, dict):
        again = [{"stem": f"{stem}{REPEAT}", **again}]
    return [{"stem": stem, **saved["layouts"][name]}, *again]


def round_fits(folder: Path, measured: dict, run: dict, how: str) -> tuple[list[StepRecord], list[Fit]]:
    """One round of a layout: its engines' logged steps, and what each level of its
    measured `run` is fitted on (`level_fits`); none where its engines logged no steps."""
    if measured["measured_from"] is None:
        return [], []
    logged = read_step_log(folder / f"{measured['stem']}-steps.jsonl")
    warm_up = folder / f"{measured['stem']}{WARM_UP}.json"
    warm_up_run = json.loads(warm_up.read_text()) if warm_up.exists() else None
    return logged, level_fits(measured, logged, warm_up_run, run, how)


def noise_floor(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each round's measured figures against the median of the other rounds' (printed:
    those that moved more than 10%), by "round k rate figure"."""
    errors: dict[str, float] = {}
    for k, mine in enumerate(rounds):
        others = median_figures([m for j, m in enumerate(rounds) if j != k])
        print(f"\nround {k + 1} against the median of the others: the figures that moved more than 10%")
        for key, value in others.items():
            moved = mine[key] / value - 1 if value else 0.0
            if abs(moved) > 0.10:
                print(f"{key:48s} others {value:9.1f}  this {mine[key]:9.1f}  {moved:+7.1%}")
        moved_by = relative_errors(mine, others)
        print_verdict(moved_by)
        errors |= {f"round {k + 1} {key}": e for key, e in moved_by.items()}
    return errors


def predict_round(
    folder: Path,
    saved: dict,
    profile: EngineProfile,
    model_spec: ModelSpec,
    name: str,
    measured: dict,
    choice: FitChoice,
) -> tuple[dict[str, float], dict[str, float]]:
    """One measurement of layout `name` (one round), predicted as the planner sees it (the
    profile's steps on the layout's cores, re-timed as `choice` says) and printed beside
    its measured run, figure by figure and, where the engines logged their steps, step by
    step; returns the predicted figures and the measured ones."""
    stem = measured["stem"]
    run = json.loads((folder / f"{stem}.json").read_text())
    client_s = measured["client_s_per_request"]
    print(f"\n{stem}: the bench client spent {client_s * 1e3:.1f} ms of CPU per request", flush=True)
    step_log = folder / f"{stem}-steps.jsonl"
    logged, fits = round_fits(folder, measured, run, choice.how)
    profiles = [profile] * len(run["levels"])
    if fits and not choice.as_calibrated:
        unique = {id(fit): fit for fit in fits}  # levels that share a fit share its profile
        fitted = {key: layout_profile(profile, name, fit, choice.waits) for key, fit in unique.items()}
        profiles = [fitted[id(fit)] for fit in fits]
    streamed = [q["output_tokens"] for lv in run["levels"] for q in lv["requests"] if q["output_tokens"]]
    deps = []
    for mine in profiles:
        dep = planned_deployment(model_spec, mine, saved["budget"], name, saved["cpus"], saved["input_len"])
        deps.append(with_client_cpu(dep, client_s / float(np.mean(streamed)) if streamed else 0.0))
    results: list[SimResult] = []
    predicted, real = predicted_figures(run, deps, results), measured_figures(run)
    print(f"\n{stem} ({' '.join(measured['argv'])})")
    print("\n".join(figure_rows(predicted, real)))
    print(f"\n{stem}: the time to first token by the server's phases")
    print("\n".join(ttft_part_rows(run, results)))
    if measured["measured_from"] is not None:
        in_run = in_windows(logged, level_windows(measured)[1])
        simulated = [(role, trace) for r in results for role, trace in zip(r.roles, r.steps, strict=True)]
        print(f"\n{stem}: the engines' steps in the measured run ({step_log}) and the simulator's")
        print("\n".join(step_rows(in_run, simulated)))
    print_verdict(relative_errors(predicted, real))
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
    return predicted, real


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
        "--repeat",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="measure each layout N times more (1 if not given), each from a fresh start, in rounds "
        "over the run; each figure predicted is compared with the median of the rounds'",
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
        "--each-level",
        action="store_true",
        help="with --replay of a --per-level run: each level's profile fitted on its own warm-up, "
        "not one on every level's warm-up",
    )
    args = p.parse_args()
    how = "measured" if args.fit_on_measured else "per-level" if args.each_level else "warm-up"
    choice = FitChoice(args.as_calibrated, not args.placed_cpu, how)
    if args.measure:
        args.model = args.bench_model
        predict(measure(args), choice)
        return
    if args.replay:
        predict(Path(args.replay), choice)
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
