"""What one simulated run gives: per request latencies and gaps, per instance load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class StepTrace(NamedTuple):
    """One engine's steps, in order: when each ended, how long it took, its tokens."""

    ends: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True)
class SimResult:
    arrival: np.ndarray
    ttft: np.ndarray  # inf for a request that could never be admitted
    tpot: np.ndarray
    worst_gap: np.ndarray
    e2e: np.ndarray
    output: np.ndarray
    gaps: list[np.ndarray]  # every inter-token gap, per request
    busy_fraction: list[float]  # per instance, while requests were arriving
    mean_batch: list[float]  # per instance: tokens emitted per step
    rejected: int
    kv_peak: list[float]  # per instance: the largest fraction of its KV memory reserved (0: no limit)
    kv_blocked: list[float]  # per instance: fraction of the arrival window a request waited for KV memory
    roles: list[str]  # per instance: "both", "prefill" or "decode"
    remote: np.ndarray | None = None  # P/D: per request, whether it was prefilled on a prefill worker
    steps: tuple[StepTrace, ...] = ()  # per instance: every step it ran

    def itl(self) -> np.ndarray:
        parts = [g for g in self.gaps if len(g)]
        return np.concatenate(parts) if parts else np.zeros(0)

    def metric_values(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Per request, the values an SLO bounds (splitserve.goodput.SLO_KEYS)."""
        every = {
            "ttft": lambda: self.ttft,
            "tpot": lambda: self.tpot,
            "gap": lambda: self.worst_gap,
            "p99_itl": self.p99_gap,
            "e2e": lambda: self.e2e,
        }
        return {k: every[k]() for k in keys}

    def p99_gap(self) -> np.ndarray:
        """Each request's own 99th-percentile inter-token gap."""
        return np.array([np.percentile(g, 99) if len(g) else 0.0 for g in self.gaps])

    def summary(self) -> dict[str, float]:
        itl = self.itl()
        ok = np.isfinite(self.ttft)
        return {
            "requests": len(self.ttft),
            "rejected": self.rejected,
            "ttft_median_s": float(np.median(self.ttft[ok])) if ok.any() else float("inf"),
            "ttft_p99_s": float(np.percentile(self.ttft[ok], 99)) if ok.any() else float("inf"),
            "itl_p50_s": float(np.percentile(itl, 50)) if len(itl) else 0.0,
            "itl_p99_s": float(np.percentile(itl, 99)) if len(itl) else 0.0,
            "tpot_median_s": float(np.median(self.tpot[ok])) if ok.any() else 0.0,
            "worst_gap_max_s": float(self.worst_gap[ok].max()) if ok.any() else 0.0,
            **(
                {"remote_fraction": float(self.remote[ok].mean()) if ok.any() else 0.0}
                if self.remote is not None
                else {}
            ),
        }
