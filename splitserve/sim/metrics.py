"""SLOs, attainment and goodput (DistServe's definition: the highest request rate at which at
least a target fraction of requests meet every latency target).

Definitions (docs/sim.md compares them with vLLM, GuideLLM and AIPerf):
- TTFT: arrival to first token.
- TPOT: (last token - first token) / (output tokens - 1), per request (vLLM's TPOT).
- ITL: every gap between two consecutive tokens of a request; "p99 ITL" pools all gaps of
  all requests (vLLM bench); an SLO on it is checked per request, on its own gaps.
- worst gap: a request's longest pause between two tokens (the stutter a user sees).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from splitserve.sim.simulator import Deployment, SimResult, simulate
from splitserve.sim.workload import Workload


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    p99_itl_s: float | None = None
    worst_gap_s: float | None = None

    def __post_init__(self) -> None:
        for v in (self.ttft_s, self.tpot_s, self.p99_itl_s, self.worst_gap_s):
            if v is not None and v <= 0:
                raise ValueError("SLO targets must be > 0")

    def met(self, r: SimResult) -> np.ndarray:
        ok = np.isfinite(r.ttft)
        if self.ttft_s is not None:
            ok &= r.ttft <= self.ttft_s
        if self.tpot_s is not None:
            ok &= r.tpot <= self.tpot_s
        if self.worst_gap_s is not None:
            ok &= r.worst_gap <= self.worst_gap_s
        if self.p99_itl_s is not None:
            ok &= r.p99_gap() <= self.p99_itl_s
        return ok

    def violations(self, r: SimResult) -> dict[str, float]:
        """Fraction of requests missing each target (which bound binds)."""
        out: dict[str, float] = {}
        if self.ttft_s is not None:
            out["ttft"] = float(np.mean(~(r.ttft <= self.ttft_s)))
        if self.tpot_s is not None:
            out["tpot"] = float(np.mean(r.tpot > self.tpot_s))
        if self.worst_gap_s is not None:
            out["worst_gap"] = float(np.mean(r.worst_gap > self.worst_gap_s))
        if self.p99_itl_s is not None:
            out["p99_itl"] = float(np.mean(r.p99_gap() > self.p99_itl_s))
        return out

    def label(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"TTFT<={self.ttft_s:g}s")
        if self.tpot_s is not None:
            parts.append(f"TPOT<={self.tpot_s * 1e3:g}ms")
        if self.p99_itl_s is not None:
            parts.append(f"p99 ITL<={self.p99_itl_s * 1e3:g}ms")
        if self.worst_gap_s is not None:
            parts.append(f"worst gap<={self.worst_gap_s * 1e3:g}ms")
        return " and ".join(parts) or "no SLO"


# The seed's two targets: the guide's benchmark (average) and no visible stutter (worst gap).
SLO_AVERAGE = SLO(ttft_s=2.0, tpot_s=0.030)
SLO_WORST_GAP = SLO(ttft_s=2.0, worst_gap_s=0.100)


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


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


WorkloadFactory = Callable[[float, int], Workload]  # (rate, seed) -> workload


def attainment(
    dep: Deployment,
    make: WorkloadFactory,
    rate: float,
    slo: SLO,
    seeds: int = 5,
    tick: Callable[[], None] | None = None,
) -> RatePoint:
    att, viol, busy, batch = [], [], [], []
    for s in range(seeds):
        r = simulate(dep, make(rate, s), seed=s)
        att.append(float(slo.met(r).mean()))
        viol.append(slo.violations(r))
        busy.append(r.busy_fraction)
        batch.append(r.mean_batch)
        if tick:
            tick()
    keys = viol[0].keys() if viol else ()
    mean_viol = {k: float(np.mean([v[k] for v in viol])) for k in keys}
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
    seeds: int = 5,
    tick: Callable[[], None] | None = None,
) -> GoodputResult:
    """Attainment at each rate, and the highest rate whose attainment reaches `target`."""
    if not 0 < target <= 1:
        raise ValueError("target must be in (0, 1]")
    points = [attainment(dep, make, r, slo, seeds, tick) for r in rates]
    ok = [p.rate for p in points if p.attainment >= target]
    return GoodputResult(max(ok) if ok else 0.0, target, points)


def search_goodput(
    dep: Deployment,
    make: WorkloadFactory,
    slo: SLO,
    lo: float,
    hi: float,
    target: float = 0.9,
    seeds: int = 3,
    iters: int = 7,
    tick: Callable[[], None] | None = None,
) -> GoodputResult:
    """Bisection on the rate between lo and hi (attainment assumed to fall with load)."""
    points: list[RatePoint] = []
    p = attainment(dep, make, lo, slo, seeds, tick)
    points.append(p)
    if p.attainment < target:
        return GoodputResult(0.0, target, points)
    p = attainment(dep, make, hi, slo, seeds, tick)
    points.append(p)
    if p.attainment >= target:
        return GoodputResult(hi, target, points)
    for _ in range(iters):
        mid = (lo + hi) / 2
        p = attainment(dep, make, mid, slo, seeds, tick)
        points.append(p)
        if p.attainment >= target:
            lo = mid
        else:
            hi = mid
    return GoodputResult(lo, target, sorted(points))
