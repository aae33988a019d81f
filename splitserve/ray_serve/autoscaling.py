"""Serve's autoscaling policy for a tier: as many replicas as the tier's own load signal
asks for (the sum over replicas of what each reports, `tier.LOAD_METRIC`, divided by the
per-replica `target`), or, for a tier `--ray-planner` sizes, the planner's target as its
replicas report it (`tier.PLANNED_METRIC`). Serve applies the tier's min/max bounds and its
up/down delays."""

from __future__ import annotations

import math
from typing import Any

from splitserve.ray_serve.tier import LOAD_METRIC, PLANNED_METRIC


class TierLoadPolicy:
    """Instantiated by Serve's controller with `policy_kwargs` ({"target": ..., "planned": ...})."""

    def __init__(self, target: float, planned: bool = False) -> None:
        self.target = target
        self.planned = planned

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        if self.planned:
            latest = latest_value(ctx.raw_metrics or {}, PLANNED_METRIC)
            if latest is not None:
                return max(1, round(latest)), {}
        loads = metrics.get(LOAD_METRIC) or {}
        if not loads:  # no report yet (replicas starting): keep what Serve aims at
            return ctx.target_num_replicas, {}
        return max(1, math.ceil(sum(loads.values()) / self.target)), {}


def latest_value(raw: dict[str, dict[Any, list[Any]]], metric: str) -> float | None:
    """The most recent report of `metric` by any replica: the planner's latest target,
    not an average over the look-back window that would lag a decision by half of it."""
    samples = [sample for series in (raw.get(metric) or {}).values() for sample in series]
    return max(samples, key=lambda sample: sample.timestamp).value if samples else None
