"""`up --ray --ray-planner`: the planner that sizes the prefill and decode tiers from the
traffic the ingress sees.

Every `interval_s` the ingress hands `FleetPlanner.decide` the last interval's traffic
(router/traffic.py: arrivals and each request's prompt and output length). It simulates
every (prefill, decode) replica count within the tiers' autoscaling bounds, each replica
on its `num_cpus` cores, with the same planner `up --plan` runs on one host
(sim/host_planner.py: the engine's measured `--profile`, else the model's roofline; the
requests drawn from the observed lengths, not their means), and picks as it does: of the
counts that meet the SLOs for `target` of requests, the fewest replicas; when none does,
the one that comes closest (of equals, the most replicas: an overload asks for more). An
interval with no arrivals asks for the lowest bounds.

The pick becomes each tier's replica target at once when it asks for more, and only when
two decisions in a row ask for fewer (`DOWNSCALE_DECISIONS`): a lull of one interval does
not tear down an engine. Tier replicas read their tier's target with their heartbeat and
report it to Serve (tier.py, autoscaling.py); Serve applies the bounds. Each decision is
logged as one JSON line with its predicted attainment and goodput.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from typing import NamedTuple

import numpy as np

from splitserve.config import SchedulerConfig
from splitserve.ray_serve.config import PLANNED_TIERS, PlannerInputs, PlannerSettings
from splitserve.router.traffic import TrafficLog, TrafficWindow
from splitserve.sim.deployment import Deployment
from splitserve.sim.host_planner import HostLayout, host_deployment, rank_layouts
from splitserve.sim.profile import load_profile
from splitserve.sim.specs import ModelSpec
from splitserve.sim.steady import SteadyState
from splitserve.sim.workload import Workload, observed

logger = logging.getLogger(__name__)

DOWNSCALE_DECISIONS = 2
# Short steady-state runs: a decision every interval, in the ingress's thread pool.
LOOP_STEADY_STATE = SteadyState(min_requests=200, max_requests=800, half_width=0.05)
LOOP_SEARCH_STEPS = 3
KEPT_DECISIONS = 1000


class TierBounds(NamedTuple):
    low: int
    high: int


class PlanDecision(NamedTuple):
    at: float  # time.time()
    rate: float  # observed arrivals per second over the interval
    requests: int
    prompt_tokens: float  # mean over the interval's requests
    output_tokens: float
    picked: dict[str, int]  # the counts the simulation picked
    targets: dict[str, int]  # what the tiers are told (the pick, downscaling held back)
    meets: bool
    attainment: float | None  # predicted, of the picked counts at the rate
    goodput: float | None  # predicted req/s the picked counts serve within the SLOs
    reason: str

    def to_json(self) -> str:
        return json.dumps(self._asdict(), sort_keys=True)


class FleetPlanner:
    """Replica targets from observed traffic; pure but for its memory of past decisions."""

    def __init__(
        self,
        base: Deployment,
        bounds: dict[str, TierBounds],
        cores_per_replica: int,
        settings: PlannerSettings,
        initial: dict[str, int] | None = None,
        steady: SteadyState = LOOP_STEADY_STATE,
    ) -> None:
        self.base = base
        self.bounds = bounds
        self.cores = cores_per_replica
        self.settings = settings
        self.steady = steady
        # until the first decision, what the tiers were deployed with
        self.targets = dict(initial) if initial else {tier: bounds[tier].low for tier in PLANNED_TIERS}
        self.lower_streak = dict.fromkeys(PLANNED_TIERS, 0)
        self.decisions: deque[PlanDecision] = deque(maxlen=KEPT_DECISIONS)

    def layouts(self) -> list[HostLayout]:
        cpus = tuple(range(self.cores))
        prefill, decode = self.bounds["prefill"], self.bounds["decode"]
        return [
            HostLayout(p, d, (cpus,) * (p + d))
            for p in range(prefill.low, prefill.high + 1)
            for d in range(max(1, decode.low), decode.high + 1)
        ]

    def decide(self, traffic: TrafficWindow) -> PlanDecision:
        lengths = np.array(traffic.lengths, dtype=float).reshape(-1, 2)
        prompt_mean = float(lengths[:, 0].mean()) if len(lengths) else 0.0
        output_mean = float(lengths[:, 1].mean()) if len(lengths) else 0.0
        if traffic.arrivals == 0:
            picked = {tier: self.bounds[tier].low for tier in PLANNED_TIERS}
            meets, attainment, goodput, reason = True, None, None, "no arrivals: the lowest bounds"
        else:
            pairs = (lengths[:, 0].astype(int), np.maximum(lengths[:, 1], 1).astype(int))

            def make(rate: float, n: int, seed: int) -> Workload:
                return observed(rate, n, pairs, seed=seed)

            ranked = rank_layouts(
                self.layouts(),
                self.base,
                make,
                self.settings.slos,
                traffic.rate,
                prompt_mean,
                self.cores,
                self.settings.target,
                self.steady,
                LOOP_SEARCH_STEPS,
            )
            # none meets the SLOs: the highest attainment, and of equals (an overload no
            # count serves, each prefill-bound at 0) the most replicas, never the fewest
            best = ranked[0]
            if not best.meets:
                best = max(ranked, key=lambda r: (r.attainment, r.layout.engines))
            picked = {"prefill": best.layout.prefill, "decode": best.layout.decode}
            meets, attainment, goodput = best.meets, best.attainment, best.goodput
            reason = "fewest replicas that meet the SLOs" if meets else "none meets the SLOs: the closest"
        decision = PlanDecision(
            time.time(),
            traffic.rate,
            traffic.arrivals,
            prompt_mean,
            output_mean,
            picked,
            self.held_back(picked),
            meets,
            attainment,
            goodput,
            reason,
        )
        self.decisions.append(decision)
        logger.warning("splitserve planner: %s", decision.to_json())
        return decision

    def held_back(self, picked: dict[str, int]) -> dict[str, int]:
        """The new targets: up at once, down after `DOWNSCALE_DECISIONS` picks below."""
        for tier in PLANNED_TIERS:
            if picked[tier] >= self.targets[tier]:
                self.lower_streak[tier] = 0
                self.targets[tier] = picked[tier]
                continue
            self.lower_streak[tier] += 1
            if self.lower_streak[tier] >= DOWNSCALE_DECISIONS:
                self.lower_streak[tier] = 0
                self.targets[tier] = picked[tier]
        return dict(self.targets)


def fleet_planner(
    model: ModelSpec,
    bounds: dict[str, TierBounds],
    num_cpus: float,
    settings: PlannerSettings,
    mode: str,
    initial: dict[str, int] | None = None,
) -> FleetPlanner:
    """The planner for a deployment whose engine replicas each ask for `num_cpus`."""
    profile = load_profile(settings.profile) if settings.profile else None
    scheduler = SchedulerConfig(
        max_num_batched_tokens=settings.max_num_batched_tokens,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
    )
    base = host_deployment(model, profile, scheduler, mode)
    return FleetPlanner(base, bounds, max(1, math.ceil(num_cpus - 1e-9)), settings, initial)


class PlannerLoop:
    """The ingress's planner task: a decision every interval, in a worker thread (a
    simulation takes a moment; the proxy's event loop keeps serving meanwhile)."""

    def __init__(self, inputs: PlannerInputs, traffic: TrafficLog) -> None:
        from splitserve.deploy.up_plan import model_spec_of
        from splitserve.model_files.resolve import resolve_model

        self.inputs = inputs
        self.traffic = traffic
        model = model_spec_of(resolve_model(inputs.model).path)
        bounds = {tier: TierBounds(*inputs.bounds[tier]) for tier in PLANNED_TIERS}
        self.planner = fleet_planner(
            model, bounds, inputs.num_cpus, inputs.settings, inputs.mode, dict(inputs.initial)
        )
        self.task: asyncio.Task | None = None

    def ensure_running(self) -> None:
        """Start the loop on the caller's event loop (the ingress has none at construction)."""
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        interval = self.inputs.settings.interval_s
        while True:
            await asyncio.sleep(interval)  # the interval's traffic, then a decision on it
            window = self.traffic.window(interval)
            try:
                await asyncio.to_thread(self.planner.decide, window)
            except Exception:  # a decision that fails leaves the targets as they were
                logger.exception("splitserve planner: the decision failed")

    def targets(self) -> dict[str, int]:
        return dict(self.planner.targets)

    def decisions(self) -> list[dict]:
        return [decision._asdict() for decision in self.planner.decisions]
