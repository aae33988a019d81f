"""Planner: for a model, a GPU type, a GPU count, a workload and an SLO, search collocated
layouts (TP size x chunk budget) and xP:yD layouts (TP per pool, instance counts), find each
one's goodput by simulation, and rank them, saying which target binds (DistServe-style
placement search, with the simulator as the oracle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from splitserve.sim.engine import SchedulerConfig
from splitserve.sim.metrics import SLO, GoodputResult, WorkloadFactory, search_goodput
from splitserve.sim.simulator import Deployment

_WHY = {
    "ttft": "TTFT: prefill capacity (queueing) or the handoff",
    "tpot": "TPOT: decode steps slowed by prefill chunks or a large batch",
    "worst_gap": "worst gap: a prefill chunk stalls the streams",
    "p99_itl": "p99 ITL: prefill chunks in decode steps",
}


class PlanRow(NamedTuple):
    label: str
    deployment: Deployment
    goodput: float
    goodput_per_gpu: float
    binding: str  # which target fails first above the goodput
    busy: dict[str, float]  # prefill busy fraction and decode batch at the goodput rate
    points: list  # RatePoint list from the search


def layouts(
    base: Deployment,
    gpus: int,
    tps: Sequence[int],
    budgets: Sequence[int],
    pd: bool = True,
    collocated: bool = True,
) -> list[Deployment]:
    """Every layout that uses exactly `gpus` GPUs."""
    out: list[Deployment] = []
    if collocated:
        for tp in tps:
            if gpus % tp == 0:
                for budget in budgets:
                    sched = replace(base.sched, budget=budget)
                    out.append(replace(base, mode="collocated", tp=tp, replicas=gpus // tp, sched=sched))
    if pd:
        for tp_p in tps:
            for tp_d in tps:
                for x in range(1, gpus // tp_p + 1):
                    rest = gpus - x * tp_p
                    if rest >= tp_d and rest % tp_d == 0:
                        out.append(
                            replace(
                                base,
                                mode="pd",
                                tp_prefill=tp_p,
                                tp_decode=tp_d,
                                prefill_instances=x,
                                decode_instances=rest // tp_d,
                            )
                        )
    return out


def capacity_guess(dep: Deployment, prompt: int) -> float:
    """Requests/s the prefill side could sustain if it did nothing else (search upper bound)."""
    if dep.mode == "collocated":
        rl, count = dep.roofline(dep.tp), dep.replicas
    else:
        rl, count = dep.roofline(dep.tp_prefill), dep.prefill_instances
    return count / rl.step_s(rl.prefill(prompt))


def binding_target(res: GoodputResult) -> str:
    failing = [p for p in res.points if p.attainment < res.target]
    if not failing:
        return "none within the searched rates"
    first = min(failing, key=lambda p: p.rate)
    if not first.violations:
        return "no SLO given"
    key = max(first.violations, key=lambda k: first.violations[k])
    return _WHY.get(key, key)


def pool_busy(dep: Deployment, res: GoodputResult) -> dict[str, float]:
    """At the highest passing rate (or the lowest tried): how busy the prefill side is while
    requests arrive, and the decode batch (a decode instance always looks busy)."""
    passing = [p for p in res.points if p.attainment >= res.target]
    point = max(passing, key=lambda p: p.rate) if passing else min(res.points, key=lambda p: p.rate)
    if dep.mode == "collocated":
        return {"busy": sum(point.busy) / len(point.busy), "batch": sum(point.batch) / len(point.batch)}
    n = dep.prefill_instances
    return {
        "prefill busy": sum(point.busy[:n]) / n,
        "decode batch": sum(point.batch[n:]) / (len(point.batch) - n),
    }


def plan(
    base: Deployment,
    gpus: int,
    make: WorkloadFactory,
    slo: SLO,
    prompt_tokens: int,
    tps: Sequence[int] = (1, 2, 4, 8),
    budgets: Sequence[int] = (512, 2048, 8192),
    target: float = 0.9,
    seeds: int = 2,
    iters: int = 5,
    tick: Callable[[], None] | None = None,
    pd: bool = True,
    collocated: bool = True,
) -> list[PlanRow]:
    rows = []
    for dep in layouts(base, gpus, tps, budgets, pd=pd, collocated=collocated):
        hi = 1.5 * capacity_guess(dep, prompt_tokens)
        res = search_goodput(dep, make, slo, hi / 64, hi, target=target, seeds=seeds, iters=iters, tick=tick)
        rows.append(
            PlanRow(
                dep.label(),
                dep,
                res.goodput,
                res.goodput / dep.gpus,
                binding_target(res),
                pool_busy(dep, res),
                res.points,
            )
        )
    rows.sort(key=lambda r: (-r.goodput, r.label))
    return rows


def search_steps(n_layouts: int, seeds: int, iters: int) -> int:
    """Simulations the plan runs at most (for a progress bar)."""
    return n_layouts * seeds * (2 + iters)


__all__ = ["PlanRow", "SchedulerConfig", "binding_target", "layouts", "plan", "pool_busy", "search_steps"]
