"""SLO attainment and goodput over short runs, averaged over seeds: the seed's method (5 runs
of 100 requests from an empty system), which `sim goodput` and `sim reproduce` keep so the
seed's tables can be compared cell by cell. The planner uses `steady.py` instead: short runs
that start empty are optimistic at high load.

SLOs and the goodput definition are splitserve.goodput's, shared with `bench`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from splitserve.goodput import SLO, distserve_goodput
from splitserve.sim.deployment import Deployment
from splitserve.sim.result import SimResult
from splitserve.sim.simulator import simulate
from splitserve.sim.workload import Workload

WorkloadFactory = Callable[[float, int, int], Workload]  # (rate, requests, seed) -> workload


def met(slo: SLO, r: SimResult) -> np.ndarray:
    """Per request: whether it met every bound (a request never admitted misses)."""
    return np.isfinite(r.ttft) & np.asarray(slo.met(r.metric_values(slo.bounds())), dtype=bool)


def miss_fractions(slo: SLO, r: SimResult, index: np.ndarray | slice = slice(None)) -> dict[str, float]:
    """Fraction of the requests at `index` missing each bound (which one binds)."""
    misses = slo.misses(r.metric_values(slo.bounds()))
    return {k: float(np.mean(np.asarray(v)[index])) for k, v in misses.items()}


class RatePoint(NamedTuple):
    rate: float
    attainment: float  # mean over seeds
    violations: dict[str, float]  # mean over seeds
    busy: list[float]  # per instance, fraction of the arrival window spent stepping (mean over seeds)
    batch: list[float]  # per instance, tokens emitted per step (mean over seeds)


class GoodputResult(NamedTuple):
    goodput: float  # highest rate meeting the target (0.0 if none)
    target: float
    points: list[RatePoint]


def attainment(
    dep: Deployment,
    make: WorkloadFactory,
    rate: float,
    slo: SLO,
    requests: int = 100,
    seeds: int = 5,
    tick: Callable[[], None] | None = None,
) -> RatePoint:
    att, viol, busy, batch = [], [], [], []
    for s in range(seeds):
        r = simulate(dep, make(rate, requests, s), seed=s)
        att.append(float(met(slo, r).mean()))
        viol.append(miss_fractions(slo, r))
        busy.append(r.busy_fraction)
        batch.append(r.mean_batch)
        if tick:
            tick()
    mean_viol = {k: float(np.mean([v[k] for v in viol])) for k in viol[0]}
    return RatePoint(
        rate,
        float(np.mean(att)),
        mean_viol,
        [float(b) for b in np.mean(busy, axis=0)],
        [float(b) for b in np.mean(batch, axis=0)],
    )


def goodput(
    dep: Deployment,
    make: WorkloadFactory,
    slo: SLO,
    rates: Sequence[float],
    target: float = 0.9,
    requests: int = 100,
    seeds: int = 5,
    tick: Callable[[], None] | None = None,
) -> GoodputResult:
    """Attainment at each rate, and the highest rate whose attainment reaches `target`."""
    points = [attainment(dep, make, r, slo, requests, seeds, tick) for r in rates]
    best = distserve_goodput([p.rate for p in points], [p.attainment for p in points], target)
    return GoodputResult(best, target, points)
