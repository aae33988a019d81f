"""What a step costs beyond its engine thread's compute on a shared host, fitted from the
step logs of the engines serving a layout (`sim retime`).

On a host where the render tier, the proxy, the engines' own API threads and the clients
share the engines' cores, a step's wall time is its compute plus the time its threads
wait for a core. Where that time lands follows the kernel's scheduler, not a rule the
simulator can derive: in the step logs (docs/sim.md) a one-core decode worker beside a
busy prefill worker waits about as long as its own streams' tiers CPU, and beside an idle
one hardly at all; a prefill worker beside a busy decode worker waits 0.6-0.9 s per second
of its compute. So the wait is fitted, per kind of engine (one that prefills for others,
one that decodes) and per state (every other engine idle when the step began, or some
other one stepping), as

    wait = per_compute * compute + per_decode_s * decodes + per_chunk_s * prompt chunks

with non-negative terms, least squares over the logged steps (wait: the step's wall time
less its engine thread's CPU). The simulator puts that beside each step it plans
(sim/engine.py) instead of placing the tiers' CPU itself.

Steps of one shape do not take one time: the logged wall times spread around the modelled
compute and fitted wait (a one-token step's p50 6.0 ms, its mean 6.2; the gaps a client
sees at p90 are the long ones). So each kind also keeps the spread of logged over
predicted wall time, as SPREAD_POINTS quantiles, and the simulator scales each step it
plans by one of them, drawn at random. Their mean is the logged steps' wall time over the
predicted, in total: drawn for the same steps, the simulated engine is busy as long as the
logged one was. It is not 1: the re-timed compute is the median's (sim/retime.py), and a
serving engine's steps are skewed long (1.04-1.12 on a `serve` engine and a prefill worker,
0.96-1.01 on a decode worker, docs/sim.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from splitserve.protocol.step_record import StepRecord, priced_steps

PREFILL, DECODE = "prefill", "decode"  # the kinds of engine a fit is kept by
MIN_STEPS = 20  # logged steps a (kind, state) needs for a fit of its own
SPREAD_POINTS = 41  # quantiles kept of a kind's logged / predicted wall times
FIELDS = ("per_compute", "per_decode_s", "per_chunk_s", "steps")


class WaitTerms(NamedTuple):
    per_compute: float  # seconds waited per second of the step's compute
    per_decode_s: float  # per sequence that decodes a token in the step
    per_chunk_s: float  # per prompt chunk the step computes
    steps: int  # the logged steps it was fitted on

    def wait_s(self, compute_s: float | np.ndarray, decodes: int, chunks: int) -> float | np.ndarray:
        return self.per_compute * compute_s + self.per_decode_s * decodes + self.per_chunk_s * chunks


class StepWaits(NamedTuple):
    """By kind of engine: (the terms when every other engine was idle, when one was
    stepping), and the spread of its steps' wall times (logged / predicted, its mean their
    totals'; empty: none)."""

    kinds: dict[str, tuple[WaitTerms, WaitTerms]]
    spreads: dict[str, tuple[float, ...]]

    def spread(self, role: str) -> tuple[float, ...]:
        return self.spreads.get(PREFILL if role == PREFILL else DECODE, ())

    def terms(self, role: str, others_stepping: bool) -> WaitTerms | None:
        """The terms for an engine of the simulator's `role` ('prefill', 'decode', 'both')."""
        pair = self.kinds.get(PREFILL if role == PREFILL else DECODE)
        return None if pair is None else pair[others_stepping]

    def to_json(self) -> dict:
        return {
            kind: {
                "others_idle": pair[0]._asdict(),
                "others_stepping": pair[1]._asdict(),
                "spread": list(self.spreads.get(kind, ())),
            }
            for kind, pair in sorted(self.kinds.items())
        }

    @classmethod
    def from_json(cls, data: object, source: str) -> StepWaits:
        """ValueError naming what is wrong."""
        if not isinstance(data, dict) or not set(data) <= {PREFILL, DECODE}:
            raise ValueError(f"{source}: maps 'prefill' and/or 'decode' to their wait terms")
        kinds, spreads = {}, {}
        for kind, pair in data.items():
            if not isinstance(pair, dict) or set(pair) - {"spread"} != {"others_idle", "others_stepping"}:
                raise ValueError(f"{source}.{kind}: needs 'others_idle' and 'others_stepping'")
            kinds[kind] = (
                terms_from_json(pair["others_idle"], f"{source}.{kind}.others_idle"),
                terms_from_json(pair["others_stepping"], f"{source}.{kind}.others_stepping"),
            )
            spread = pair.get("spread", [])
            if not isinstance(spread, list) or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in spread
            ):
                raise ValueError(f"{source}.{kind}.spread: a list of numbers > 0")
            if spread:
                spreads[kind] = tuple(float(x) for x in spread)
        return cls(kinds, spreads)


def terms_from_json(data: object, source: str) -> WaitTerms:
    if not isinstance(data, dict) or set(data) != set(FIELDS):
        raise ValueError(f"{source}: needs exactly {', '.join(FIELDS)}")
    values = [data[name] for name in FIELDS]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in values):
        raise ValueError(f"{source}: every term must be a number >= 0")
    return WaitTerms(float(values[0]), float(values[1]), float(values[2]), int(values[3]))


class LoggedStep(NamedTuple):
    record: StepRecord
    kind: str
    compute_s: float
    wait_s: float
    decodes: int
    chunks: int
    others_stepping: bool


def logged_steps(records: Sequence[StepRecord]) -> list[LoggedStep]:
    """Each logged step with a shape (`priced_steps`), its compute (the engine thread's CPU
    for it), its wait (the rest of its wall time), and whether another process was mid-step
    as it began."""
    spans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for pid in {r.pid for r in records}:
        ends = np.array(sorted(r.t for r in records if r.pid == pid))
        starts = np.array(sorted(r.t - r.step_s for r in records if r.pid == pid))
        spans[pid] = (starts, ends)

    def stepping(pid: int, at: float) -> bool:
        starts, ends = spans[pid]
        i = int(np.searchsorted(ends, at, side="right"))  # the first step ending after `at`
        return i < len(starts) and starts[i] <= at

    out = []
    for r, compute in priced_steps(records):
        start = r.t - r.step_s
        others = any(stepping(pid, start) for pid in spans if pid != r.pid)
        kind = PREFILL if r.role == PREFILL else DECODE
        wait = max(0.0, r.step_s - compute)
        out.append(LoggedStep(r, kind, compute, wait, r.decodes, len(r.chunks), others))
    return out


def fit_terms(steps: Sequence[LoggedStep]) -> WaitTerms:
    """Non-negative least squares of the waits on (compute, decodes, chunks): the best of
    the unconstrained fits over every subset of the three terms whose terms are all >= 0."""
    x = np.array([[s.compute_s, s.decodes, s.chunks] for s in steps], dtype=float)
    y = np.array([s.wait_s for s in steps])
    best, best_error = np.zeros(3), float(np.sum(y**2))
    for size in (1, 2, 3):
        for subset in itertools.combinations(range(3), size):
            columns = list(subset)
            coef, *_ = np.linalg.lstsq(x[:, columns], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[columns] = coef
            error = float(np.sum((x @ full - y) ** 2))
            if error < best_error:
                best, best_error = full, error
    return WaitTerms(float(best[0]), float(best[1]), float(best[2]), len(steps))


def fit_step_waits(
    records: Sequence[StepRecord], compute_s: Callable[[StepRecord], float | None]
) -> StepWaits | None:
    """The waits of each kind of engine in the log (None when no step has a shape), and
    the spread of its steps' wall times around `compute_s(record)` (the modelled compute,
    None where there is no model for it) and the fitted wait. A state with fewer than
    MIN_STEPS steps takes the kind's fit over all of its steps."""
    steps = logged_steps(records)
    kinds, spreads = {}, {}
    for kind in (PREFILL, DECODE):
        mine = [s for s in steps if s.kind == kind]
        if not mine:
            continue
        overall = fit_terms(mine)
        by_state = []
        for state in (False, True):
            in_state = [s for s in mine if s.others_stepping == state]
            by_state.append(fit_terms(in_state) if len(in_state) >= MIN_STEPS else overall)
        kinds[kind] = (by_state[0], by_state[1])
        walls, predicted = [], []
        for s in mine:
            modelled = compute_s(s.record)
            if modelled is not None and modelled > 0:
                walls.append(s.record.step_s)
                predicted.append(modelled + by_state[s.others_stepping].wait_s(modelled, s.decodes, s.chunks))
        if len(walls) >= MIN_STEPS:
            ratios = np.array(walls) / np.array(predicted)
            points = np.quantile(ratios, (np.arange(SPREAD_POINTS) + 0.5) / SPREAD_POINTS)
            busy = float(np.sum(walls) / np.sum(predicted))  # the spread's mean (module doc)
            spreads[kind] = tuple(float(x) for x in points / points.mean() * busy)
    return StepWaits(kinds, spreads) if kinds else None


def wait_rows(waits: StepWaits) -> list[str]:
    """One line per kind and state: its fitted terms."""
    rows = []
    for kind, pair in sorted(waits.kinds.items()):
        for state, t in zip(("others idle", "another stepping"), pair, strict=True):
            rows.append(
                f"{kind} waits ({state}): {t.per_compute:.3f} s/s of compute + {t.per_decode_s * 1e3:.3f} ms"
                f"/decode + {t.per_chunk_s * 1e3:.3f} ms/prompt chunk ({t.steps} steps)"
            )
    return rows
