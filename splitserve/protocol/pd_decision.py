"""Conditional disaggregation: whether a request's prompt is prefilled on a prefill worker
(and its KV handed to decode) or on the decode worker itself, decided on cost.

The decision is a pure function of its inputs (`decide`): the prompt tokens decode does
not hold, decode's live load, the prefill worker's queue, and this deployment's costs
(`CostModel`). It compares, in seconds, what each path costs the whole system:

- local (decode prefills): the requester's first token waits for decode's queued prefill
  tokens and its own (`decode_prefill_s_per_token` each); every stream decode is running
  stalls for that prefill too (`stall_fraction` of it: a chunked prefill rides in the
  same steps as their decodes), and decode is charged for at least `min_charged_streams`
  streams, since a request that arrives while decode computes a long prompt waits for all
  of it (0: an idle decode's time is free, pure TTFT);
- remote (P/D): the requester's first token waits for the prefill worker's queue and its
  own prefill (`prefill_s_per_token`), plus the handoff (`handoff_fixed_s`: the proxy's
  extra hops, the reservation, the notification; `handoff_s_per_token`: the KV transfer
  not hidden behind the layer-by-layer compute); decode's streams do not wait.

Remote wins when it is cheaper. `break_even_tokens` solves for the prompt length where
the two meet. The numbers come from a profile file (`load_cost_profile`) or are measured
by the proxy (router/pd_costs.py); this module only computes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import NamedTuple


class CostProfileError(ValueError):
    pass


@dataclass(frozen=True)
class CostModel:
    # Defaults, until a profile or a measurement says otherwise: a small model on a few
    # CPU cores (the tiny test models prefill at ~30 us/token on 2 shared cores; the
    # proxy's extra hops for a P/D request cost ~10-30 ms there).
    handoff_fixed_s: float = 0.02
    handoff_s_per_token: float = 0.0
    prefill_s_per_token: float = 50e-6  # on the prefill worker
    decode_prefill_s_per_token: float = 50e-6  # on the decode worker
    stall_fraction: float = 1.0
    min_charged_streams: float = 1.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CostProfileError(f"{field.name} must be a finite number, not {value!r}")
            if value < 0:
                raise CostProfileError(f"{field.name} must be >= 0, not {value!r}")
        if self.prefill_s_per_token <= 0 or self.decode_prefill_s_per_token <= 0:
            raise CostProfileError("prefill costs per token must be > 0")


COST_FIELDS = tuple(field.name for field in dataclasses.fields(CostModel))


class DecisionInputs(NamedTuple):
    uncached_tokens: int  # prompt tokens minus what decode holds (its prefix-cache hit)
    decode_streams: int  # requests decoding on the decode worker
    decode_queued_tokens: int  # prompt tokens queued for prefill on the decode worker
    prefill_queued_tokens: int  # prompt tokens queued on the (least loaded) prefill worker


class PDDecision(NamedTuple):
    remote: bool  # prefill on a prefill worker (P/D); False: on the decode worker
    local_cost_s: float
    remote_cost_s: float
    reason: str


def local_cost_s(inputs: DecisionInputs, costs: CostModel) -> float:
    """The requester's TTFT on decode plus the stall its prefill inflicts on decode's streams."""
    prefill_s = inputs.uncached_tokens * costs.decode_prefill_s_per_token
    ttft = inputs.decode_queued_tokens * costs.decode_prefill_s_per_token + prefill_s
    streams = max(float(inputs.decode_streams), costs.min_charged_streams)
    return ttft + streams * costs.stall_fraction * prefill_s


def remote_cost_s(inputs: DecisionInputs, costs: CostModel) -> float:
    """The requester's TTFT through a prefill worker and the handoff."""
    computed = inputs.prefill_queued_tokens + inputs.uncached_tokens
    handoff = costs.handoff_fixed_s + inputs.uncached_tokens * costs.handoff_s_per_token
    return computed * costs.prefill_s_per_token + handoff


def decide(inputs: DecisionInputs, costs: CostModel) -> PDDecision:
    """Remote prefill when it costs the system less than prefilling on decode."""
    local, remote = local_cost_s(inputs, costs), remote_cost_s(inputs, costs)
    if inputs.uncached_tokens <= 0:
        return PDDecision(False, local, remote, "decode holds the prompt")
    if remote < local:
        return PDDecision(True, local, remote, "remote is cheaper")
    return PDDecision(False, local, remote, "local is cheaper")


def threshold_decision(inputs: DecisionInputs, min_prefill_tokens: int, costs: CostModel) -> PDDecision:
    """The fixed rule (`--pd-decision threshold`): remote from `min_prefill_tokens` uncached
    tokens on, whatever the load; the costs are only reported."""
    remote = inputs.uncached_tokens >= min_prefill_tokens
    reason = f"{'at least' if remote else 'under'} {min_prefill_tokens} uncached tokens"
    return PDDecision(remote, local_cost_s(inputs, costs), remote_cost_s(inputs, costs), reason)


def break_even_tokens(
    costs: CostModel, decode_streams: int = 0, decode_queued_tokens: int = 0, prefill_queued_tokens: int = 0
) -> float:
    """The uncached prompt length from which remote prefill is cheaper, at this load
    (`math.inf`: never; 0: always). Both costs are linear in it."""
    streams = max(float(decode_streams), costs.min_charged_streams)
    slope = (
        costs.decode_prefill_s_per_token * (1 + streams * costs.stall_fraction)
        - costs.prefill_s_per_token
        - costs.handoff_s_per_token
    )
    offset = (
        costs.handoff_fixed_s
        + prefill_queued_tokens * costs.prefill_s_per_token
        - decode_queued_tokens * costs.decode_prefill_s_per_token
    )
    if slope <= 0:
        return 0.0 if offset < 0 else math.inf
    return max(0.0, offset / slope)


class CostProfile(NamedTuple):
    costs: CostModel
    pinned: frozenset[str]  # the fields the file named: they are not replaced by measurements


def parse_cost_profile(data: object, source: str = "profile") -> CostProfile:
    """A profile: {field: number} for any of `CostModel`'s fields, and optionally the
    prefill step times `splitserve sim calibrate --engine URL --save FILE` writes
    ("samples"; "model", "gpu" and "sim", the simulator's own part of a `sim calibrate
    --out` profile, are ignored): their fitted cost per prompt token stands for both
    prefill costs the profile does not name."""
    if not isinstance(data, dict):
        raise CostProfileError(f"{source}: expected a JSON object of cost fields")
    unknown = sorted(set(data) - set(COST_FIELDS) - {"samples", "model", "gpu", "sim"})
    if unknown:
        raise CostProfileError(
            f"{source}: unknown field {unknown[0]!r} (fields: {', '.join(COST_FIELDS)}, samples)"
        )
    values = {name: data[name] for name in COST_FIELDS if name in data}
    if "samples" in data:
        per_token = prefill_s_per_token_from_samples(data["samples"], source)
        values.setdefault("prefill_s_per_token", per_token)
        values.setdefault("decode_prefill_s_per_token", per_token)
    try:
        costs = CostModel(**values)
    except CostProfileError as exc:
        raise CostProfileError(f"{source}: {exc}") from None
    return CostProfile(costs, frozenset(values))


def load_cost_profile(path: str) -> CostProfile:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CostProfileError(f"--pd-cost-profile {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostProfileError(f"--pd-cost-profile {path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CostProfileError(f"--pd-cost-profile {path}: not JSON ({exc})") from None
    return parse_cost_profile(data, f"--pd-cost-profile {path}")


def prefill_s_per_token_from_samples(samples: object, source: str = "profile") -> float:
    """The slope of prefill step time over prompt tokens (least squares) in `sim
    calibrate`'s samples: the prefill steps on an empty cache."""
    if not isinstance(samples, list):
        raise CostProfileError(f"{source}: samples must be a list")
    points: list[tuple[float, float]] = []
    for i, row in enumerate(samples):
        if not isinstance(row, dict):
            raise CostProfileError(f"{source}: sample {i} must be an object")
        if row.get("kind") != "prefill" or row.get("context_len", 0) != 0:
            continue
        try:
            points.append((float(row["num_tokens"]), float(row["step_time_s"])))
        except (KeyError, TypeError, ValueError):
            raise CostProfileError(f"{source}: sample {i} needs numeric num_tokens and step_time_s") from None
    if len({n for n, _ in points}) < 2:
        raise CostProfileError(f"{source}: samples need prefill steps of at least two prompt lengths")
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n, _ in points)
    if not slope > 0:
        raise CostProfileError(f"{source}: the samples' prefill time does not grow with the prompt")
    return slope
