"""Serve's autoscaling policy for a tier: as many replicas as the tier's own load signal
asks for (the sum over replicas of what each reports, `tier.LOAD_METRIC`, divided by the
per-replica `target`). Serve applies the tier's min/max bounds and its up/down delays."""

from __future__ import annotations

import math
from typing import Any

from splitserve.ray_serve.tier import LOAD_METRIC


class TierLoadPolicy:
    """Instantiated by Serve's controller with `policy_kwargs` ({"target": ...})."""

    def __init__(self, target: float) -> None:
        self.target = target

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        loads = (ctx.aggregated_metrics or {}).get(LOAD_METRIC) or {}
        if not loads:  # no report yet (replicas starting): keep what Serve aims at
            return ctx.target_num_replicas, {}
        return max(1, math.ceil(sum(loads.values()) / self.target)), {}
