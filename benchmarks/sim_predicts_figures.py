"""The figures `bench_sim_predicts_bench.py` sets side by side: a saved `splitserve bench`
run's, by "rate figure" (TTFT and ITL in ms, attainment in %) and "goodput slo", and the
simulator's for the same arrivals (`predicted_figures`); how far apart they are, and the
median of several rounds' figures, where a layout was measured more than once (`--repeat`:
one round that ran through one of the host's slow patches does not decide it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.goodput import SLO, arrival_times, distserve_goodput
from splitserve.sim import Deployment, Workload, simulate
from splitserve.sim.metrics import met
from splitserve.sim.result import SimResult

# each level is simulated this many times, with different draws of the steps' spread, of the
# tokens' relay and of random routing, and its figures taken over every run's requests: at
# the same arrivals, one run's TTFT p90 moved by up to 27 points from one seed to the next
# (docs/sim.md)
SIM_RUNS = 16

# the figures issue 27's must-hold names (the rest are printed, and counted apart)
MUST_HOLD = ("TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "goodput")


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


def median_figures(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over rounds that have the same figures."""
    return {key: float(np.median([figures[key] for figures in rounds])) for key in rounds[0]}


def predicted_figures(
    run: dict, deps: Sequence[Deployment], results: list[SimResult] | None = None
) -> dict[str, float]:
    """Each level of a saved bench run predicted by simulating its deployment (`deps`, one
    per level) on its arrivals, named as `measured_figures` names the run's. `results`,
    when given, gets the first of each level's simulations."""
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
    return predicted


def figure_rows(predicted: dict[str, float], measured: dict[str, float]) -> list[str]:
    """One printable row per measured figure: the simulator's beside bench's."""
    rows = []
    for key, meas in measured.items():
        pred = predicted[key]
        if key.startswith("goodput "):
            rows.append(f"{key:36s} sim {pred:g} req/s  bench {meas:g} req/s")
        else:
            rate, name = key.split(" ", 1)
            err = f"{pred / meas - 1:+7.1%}" if meas else "      -"
            rows.append(f"{rate:>6s} req/s  {name:36s} sim {pred:9.1f}  bench {meas:9.1f}  {err}")
    return rows


def compare(
    run: dict, deps: Sequence[Deployment], results: list[SimResult] | None = None
) -> tuple[list[str], dict[str, float]]:
    """`predicted_figures` beside the run's own: one printable row per figure, and the
    relative error of every figure measured non-zero, by "rate figure"."""
    predicted, measured = predicted_figures(run, deps, results), measured_figures(run)
    return figure_rows(predicted, measured), relative_errors(predicted, measured)


def print_verdict(errors: dict[str, float]) -> None:
    named = {k: e for k, e in errors.items() if any(f in k for f in MUST_HOLD)}
    for label, chosen in (("every figure", errors), ("the must-hold's (TTFT, ITL p50/p90, goodput)", named)):
        values = list(chosen.values())
        within = sum(e <= 0.10 for e in values)
        median = np.median(values) if values else float("nan")
        print(f"{label}: within 10% (measured non-zero) {within}/{len(values)}; median |error| {median:.1%}")
