"""Which requests a P/D deployment sends through a prefill worker: the conditional-
disaggregation decision, as the simulator and planner apply it.

The formula is router/pd_decision.py's `decide` (a test holds the two equal on a grid of
inputs); `sim` imports nothing outside the standard library, numpy and its own files, so
it is restated here rather than imported. Local (decode prefills): the requester waits for
decode's queued prompt tokens and its own, and every stream decode runs (at least
`min_charged_streams`) stalls for `stall_fraction` of that prefill. Remote: the prefill
worker's queue and the prompt at `prefill_s_per_token`, plus the handoff. Remote wins when
it is cheaper; a prompt decode already holds stays local.

The costs are the profile file's top-level fields, the same ones `--pd-cost-profile` pins
in the proxy (`sim calibrate --engine URL --out FILE` writes them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PDCosts:
    # the proxy's defaults (router/pd_decision.py CostModel) until a profile names them
    handoff_fixed_s: float = 0.02
    handoff_s_per_token: float = 0.0
    prefill_s_per_token: float = 50e-6
    decode_prefill_s_per_token: float = 50e-6
    stall_fraction: float = 1.0
    min_charged_streams: float = 1.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{field.name} must be a finite number, not {value!r}")
            if value < 0:
                raise ValueError(f"{field.name} must be >= 0, not {value!r}")
        if self.prefill_s_per_token <= 0 or self.decode_prefill_s_per_token <= 0:
            raise ValueError("prefill costs per token must be > 0")


PD_COST_FIELDS = tuple(field.name for field in dataclasses.fields(PDCosts))


def local_cost_s(
    uncached_tokens: int, decode_streams: int, decode_queued_tokens: int, costs: PDCosts
) -> float:
    prefill_s = uncached_tokens * costs.decode_prefill_s_per_token
    ttft = decode_queued_tokens * costs.decode_prefill_s_per_token + prefill_s
    streams = max(float(decode_streams), costs.min_charged_streams)
    return ttft + streams * costs.stall_fraction * prefill_s


def remote_cost_s(uncached_tokens: int, prefill_queued_tokens: int, costs: PDCosts) -> float:
    handoff = costs.handoff_fixed_s + uncached_tokens * costs.handoff_s_per_token
    return (prefill_queued_tokens + uncached_tokens) * costs.prefill_s_per_token + handoff


def goes_remote(
    uncached_tokens: int,
    decode_streams: int,
    decode_queued_tokens: int,
    prefill_queued_tokens: int,
    costs: PDCosts,
) -> bool:
    if uncached_tokens <= 0:
        return False
    local = local_cost_s(uncached_tokens, decode_streams, decode_queued_tokens, costs)
    return remote_cost_s(uncached_tokens, prefill_queued_tokens, costs) < local
