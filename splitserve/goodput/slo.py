"""SLOs and goodput.

Per request (docs/bench.md and docs/sim.md give the definitions and compare them with vLLM,
GuideLLM and AIPerf): `ttft` arrival to first token; `tpot` (last - first token) /
(output tokens - 1); `gap` the request's worst gap between two tokens; `p99_itl` the 99th
percentile of the request's own gaps; `e2e` arrival to last token.

An SLO is a set of upper bounds on those values; a request meets it when it meets every
bound. Goodput (DistServe): the highest offered rate at which at least a required fraction
of requests meet the SLO.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SLO_KEYS = ("ttft", "tpot", "gap", "p99_itl", "e2e")
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "gap": "worst gap", "p99_itl": "p99 ITL", "e2e": "E2E"}
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us)\s*$")


def parse_duration(text: str) -> float:
    """'2s' -> 2.0, '30ms' -> 0.03, '500us' -> 0.0005. A unit is required."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"bad duration {text!r}: give a number and a unit (s, ms or us), e.g. 2s or 30ms")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_duration(seconds: float) -> str:
    if seconds >= 1 or seconds == 0:
        return f"{seconds:g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds * 1e6:g}us"


@dataclass(frozen=True)
class SLO:
    """Upper bounds, in seconds, on a request's latencies; None: no bound."""

    ttft: float | None = None
    tpot: float | None = None
    gap: float | None = None
    p99_itl: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        if not self.bounds():
            raise ValueError(f"an SLO needs at least one bound ({', '.join(SLO_KEYS)})")
        if any(not v > 0 for v in self.bounds().values()):
            raise ValueError("SLO bounds must be > 0")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft=2s,tpot=30ms,gap=100ms,p99_itl=50ms,e2e=10s`, any non-empty subset."""
        bounds: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(
                    f"bad SLO term {part.strip()!r} in {text!r}: use KEY=DURATION, KEY one of {SLO_KEYS}"
                )
            if key in bounds:
                raise ValueError(f"SLO {text!r} gives {key} twice")
            bounds[key] = parse_duration(value)
        return cls(**bounds)

    def bounds(self) -> dict[str, float]:
        values = {k: getattr(self, k) for k in SLO_KEYS}
        return {k: v for k, v in values.items() if v is not None}

    @property
    def name(self) -> str:
        """The SLO in the form `parse` reads: `ttft=2s,tpot=30ms`."""
        return ",".join(f"{k}={format_duration(v)}" for k, v in self.bounds().items())

    def label(self) -> str:
        return " and ".join(f"{_LABELS[k]}<={format_duration(v)}" for k, v in self.bounds().items())

    def met(self, values: Mapping[str, Any]) -> Any:
        """Whether every bound holds. `values` maps each bounded key to one request's value
        (a float; None when the request produced nothing) or to an array of values, one per
        request (then the answer is an array of booleans; NaN never meets a bound)."""
        ok: Any = True
        for key, bound in self.bounds().items():
            value = values[key]
            if value is None:
                return False
            ok = ok & (value <= bound)
        return ok

    def misses(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Per bound: whether it is missed (same shapes as `met`)."""
        return {key: ~(values[key] <= bound) for key, bound in self.bounds().items()}


# The seed's two targets: the guide's benchmark (average) and no visible stutter (worst gap).
SLO_AVERAGE = SLO(ttft=2.0, tpot=0.030)
SLO_WORST_GAP = SLO(ttft=2.0, gap=0.100)


def distserve_goodput(rates: Sequence[float], attainments: Sequence[float], required: float) -> float:
    """Highest offered rate whose attainment is at least `required` (0 if none)."""
    if not 0 < required <= 1:
        raise ValueError("the required attainment must be in (0, 1]")
    meeting = [rate for rate, att in zip(rates, attainments, strict=True) if att >= required]
    return max(meeting, default=0.0)


def interpolated_goodput(rates: Sequence[float], attainments: Sequence[float], required: float) -> float:
    """DistServe's goodput read off the attainment curve drawn straight between swept rates:
    the highest rate at which that line is at or above `required`, so a coarse sweep gives
    where the target is lost, not just the last level that kept it. Never past the highest
    swept rate, and never toward an unbounded one; 0 if no level meets it."""
    best = distserve_goodput(rates, attainments, required)
    for (rate, attained), (next_rate, next_attained) in itertools.pairwise(
        zip(rates, attainments, strict=True)
    ):
        if attained >= required > next_attained and not math.isinf(next_rate):
            crossing = rate + (next_rate - rate) * (attained - required) / (attained - next_attained)
            best = max(best, crossing)
    return best
