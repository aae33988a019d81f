"""The P/D decision's costs as this proxy measures them (protocol/pd_decision.py computes).

- Prefill cost per token: from the load polls (`GET /inference/v1/stats`), which carry each
  engine's last step (`last_step_time_s`, `last_step_tokens`). A prefill worker's steps are
  all prefill (it is asked for one token per request), so every new step of at least
  `MIN_STEP_TOKENS` tokens (below that the fixed cost of a step dominates) updates a moving
  average of seconds per token. Steps that ran on an idle decode's CPUs as well
  (`last_step_borrowed`, engine/cpu_lending.py) count as they are: they are what a
  remote prefill costs while decode is idle, and an idle stack's prefill steps are all
  such steps (skipping them left the default in place and the handoff's estimate took in
  the whole prefill). A decode worker's steps mix decodes into its prefills, so
  its own figure is not taken from them: the same engine on the same hardware prefills at
  the prefill worker's rate, and a profile names a difference (cores, threads).
- Handoff: the proxy times every first token, on both paths. What a path's TTFT spends
  beyond the prefill compute the model predicts for it is that path's fixed cost (HTTP
  hops, the first decode step, the notification); the handoff is the remote path's fixed
  cost minus the local one's, each the median of its last `FIXED_WINDOW` first tokens, so
  it follows the deployment and one slow first token does not move it.

A profile (`--pd-cost-profile`) pins the fields it names; measurements fill in the rest,
and defaults (`CostModel()`) stand until a measurement lands.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque

from splitserve.protocol.pd_decision import CostModel, CostProfile, DecisionInputs, break_even_tokens

MIN_STEP_TOKENS = 128
SMOOTHING = 0.2  # weight of each new observation in the moving average of the prefill cost
# first tokens whose median is each path's fixed cost: one slow outlier (a fresh stack's
# first KV transfer took 123 ms against 65 for the next ones) once set a moving average
# that 9 more first tokens left 10 ms high, and `sim calibrate --pd` read it
FIXED_WINDOW = 15


def _moving_average(previous: float | None, value: float) -> float:
    return value if previous is None else previous + SMOOTHING * (value - previous)


def _median(values: deque[float]) -> float | None:
    return statistics.median(values) if values else None


class CostCalibrator:
    def __init__(self, profile: CostProfile | None = None) -> None:
        self.profile = profile
        self._prefill_s_per_token: float | None = None
        self._local_fixed_s: deque[float] = deque(maxlen=FIXED_WINDOW)
        self._remote_fixed_s: deque[float] = deque(maxlen=FIXED_WINDOW)
        self._last_steps: dict[str, tuple[float, int]] = {}  # per worker URL: last step seen

    def observe_stats(self, url: str, role: str, stats: dict) -> None:
        """A worker's load report; a prefill worker's new long step updates its cost per token."""
        try:
            step = (float(stats["last_step_time_s"]), int(stats["last_step_tokens"]))
        except (KeyError, TypeError, ValueError):
            return
        if self._last_steps.get(url) == step:
            return  # the step an earlier poll already saw (an idle engine reports it again)
        self._last_steps[url] = step
        step_s, tokens = step
        if role == "prefill" and tokens >= MIN_STEP_TOKENS and step_s > 0:
            self._prefill_s_per_token = _moving_average(self._prefill_s_per_token, step_s / tokens)

    def observe_first_token(self, inputs: DecisionInputs, remote: bool, ttft_s: float) -> None:
        """One request's time to first token on the path it took, with the inputs its
        decision saw."""
        costs = self.costs()
        if remote:
            computed = (inputs.prefill_queued_tokens + inputs.uncached_tokens) * costs.prefill_s_per_token
            per_token = inputs.uncached_tokens * costs.handoff_s_per_token
            self._remote_fixed_s.append(ttft_s - computed - per_token)
        else:
            tokens = inputs.decode_queued_tokens + max(1, inputs.uncached_tokens)
            computed = tokens * costs.decode_prefill_s_per_token
            self._local_fixed_s.append(ttft_s - computed)

    def forget(self, url: str) -> None:
        self._last_steps.pop(url, None)

    def measured(self) -> dict[str, float]:
        """What the proxy has measured so far, by cost field."""
        out: dict[str, float] = {}
        if self._prefill_s_per_token is not None:
            out["prefill_s_per_token"] = self._prefill_s_per_token
            out["decode_prefill_s_per_token"] = self._prefill_s_per_token
        remote = _median(self._remote_fixed_s)
        if remote is not None:
            # before any local first token, the local path's fixed cost counts as nothing
            # (the handoff is overestimated: fewer requests go remote, never wrongly more)
            out["handoff_fixed_s"] = max(0.0, remote - (_median(self._local_fixed_s) or 0.0))
        return out

    def costs(self) -> CostModel:
        """The costs the decision uses now: the profile's pinned fields, then measurements,
        then defaults."""
        values = self.measured()
        if self.profile is not None:
            values.update({name: getattr(self.profile.costs, name) for name in self.profile.pinned})
            return dataclasses.replace(self.profile.costs, **values)
        return CostModel(**values)

    def snapshot(self) -> dict:
        """For /workers: the costs in use, where each came from, and the raw measurements."""
        measured = self.measured()
        pinned = self.profile.pinned if self.profile is not None else frozenset()
        costs = self.costs()
        idle = break_even_tokens(costs)
        return {
            "costs": dataclasses.asdict(costs),
            "break_even_tokens_idle": None if math.isinf(idle) else math.ceil(idle),
            "source": {
                name: "profile" if name in pinned else "measured" if name in measured else "default"
                for name in dataclasses.asdict(costs)
            },
            "measured": measured,
            "local_fixed_s": _median(self._local_fixed_s),
            "remote_fixed_s": _median(self._remote_fixed_s),
        }
