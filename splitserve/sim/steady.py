"""Steady-state SLO attainment: what a deployment delivers once it has been serving a rate
for a while, not over its first minutes from empty.

One long run per estimate, from the same seed for every design (common random numbers: the
designs see the same requests at the same times). The first `warmup` fraction of requests
is discarded (the queues are still filling) and so is the last `cooldown` fraction (arrivals
stop, the queues drain). The rest is cut into `BATCHES` consecutive batches; the spread of
the batch means gives a 95% confidence interval. The run doubles in length until the
interval is tight, or lies wholly on one side of the target attainment, and the queue is
not still growing (the mean TTFT of the last batch is not far above the first's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from splitserve.goodput import SLO
from splitserve.sim.deployment import Deployment
from splitserve.sim.metrics import WorkloadFactory, met, miss_fractions
from splitserve.sim.result import SimResult
from splitserve.sim.simulator import simulate

BATCHES = 10
T_95 = 2.262  # Student's t, 95% two-sided, BATCHES - 1 degrees of freedom


@dataclass(frozen=True)
class SteadyState:
    warmup: float = 0.2  # fraction of requests discarded at the start
    cooldown: float = 0.05  # ... and at the end
    min_requests: int = 400
    max_requests: int = 6400
    half_width: float = 0.02  # stop when the 95% interval is this tight
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.warmup < 1 and 0 <= self.cooldown < 1 and self.warmup + self.cooldown < 0.9):
            raise ValueError("warm-up and cool-down are fractions of the run that leave most of it")
        if not BATCHES * 2 <= self.min_requests <= self.max_requests:
            raise ValueError(f"need {BATCHES * 2} <= min_requests <= max_requests")
        if not self.half_width > 0:
            raise ValueError("half_width must be > 0")


class Estimate(NamedTuple):
    rate: float
    attainment: float  # fraction of measured requests meeting every SLO
    half_width: float  # of its 95% confidence interval
    per_slo: dict[str, float]  # attainment of each SLO alone
    misses: dict[str, float]  # fraction of measured requests missing each bound (any SLO)
    requests: int  # simulated
    measured: int
    growing: bool  # the queue was still growing at the end of the longest run
    result: SimResult


def _window(r: SimResult, cfg: SteadyState) -> np.ndarray:
    """Indices of the measured requests, in arrival order."""
    order = np.argsort(r.arrival, kind="stable")
    n = len(order)
    return order[int(n * cfg.warmup) : n - int(n * cfg.cooldown)]


def _batch_means(values: np.ndarray) -> np.ndarray:
    return np.array([b.mean() for b in np.array_split(values, BATCHES)])


def estimate(
    dep: Deployment,
    make: WorkloadFactory,
    rate: float,
    slos: Sequence[SLO],
    cfg: SteadyState = SteadyState(),
    target: float | None = None,
    tick: Callable[[], None] | None = None,
) -> Estimate:
    n = cfg.min_requests
    while True:
        r = simulate(dep, make(rate, n, cfg.seed), seed=cfg.seed)
        if tick:
            tick()
        idx = _window(r, cfg)
        ok_each = {s.name: met(s, r)[idx] for s in slos}
        ok = np.logical_and.reduce(list(ok_each.values()))
        means = _batch_means(ok.astype(float))
        mean = float(ok.mean())
        half = float(T_95 * means.std(ddof=1) / np.sqrt(BATCHES))
        ttft = _batch_means(np.where(np.isfinite(r.ttft[idx]), r.ttft[idx], 1e9))
        growing = bool(ttft[-1] > 1.5 * ttft[0] + 0.05 and ttft[-1] > ttft[: BATCHES // 2].max())
        decided = half <= cfg.half_width or (target is not None and abs(mean - target) > half)
        if (decided and not growing) or n >= cfg.max_requests or len(r.ttft) < n:
            misses: dict[str, float] = {}
            for s in slos:
                for k, v in miss_fractions(s, r, idx).items():
                    misses[k] = max(misses.get(k, 0.0), v)
            per_slo = {name: float(v.mean()) for name, v in ok_each.items()}
            return Estimate(rate, mean, half, per_slo, misses, len(r.ttft), len(idx), growing, r)
        n = min(2 * n, cfg.max_requests)


class GoodputSearch(NamedTuple):
    goodput: float  # highest rate found to meet the target (0.0 if not even `lo`)
    meeting: Estimate | None  # the estimate at `goodput`
    failing: Estimate | None  # the lowest rate found to miss it (what binds just above goodput)


def search_goodput(
    dep: Deployment,
    make: WorkloadFactory,
    slos: Sequence[SLO],
    lo: float,
    hi: float,
    target: float = 0.9,
    cfg: SteadyState = SteadyState(),
    iters: int = 6,
    tick: Callable[[], None] | None = None,
    at_lo: Estimate | None = None,
) -> GoodputSearch:
    """Bisection between `lo` and `hi` on steady-state attainment (assumed to fall with load).
    `at_lo`: an estimate already made at `lo`."""
    low = at_lo or estimate(dep, make, lo, slos, cfg, target, tick)
    if low.attainment < target:
        return GoodputSearch(0.0, None, low)
    high = estimate(dep, make, hi, slos, cfg, target, tick)
    if high.attainment >= target:
        return GoodputSearch(hi, high, None)
    for _ in range(iters):
        mid = (low.rate + high.rate) / 2
        e = estimate(dep, make, mid, slos, cfg, target, tick)
        if e.attainment >= target:
            low = e
        else:
            high = e
    return GoodputSearch(low.rate, low, high)
