"""Planner: how many of each for this rate. For a model, a GPU type, a workload, SLOs and a
request rate, the cheapest layouts (fewest GPUs: collocated replicas with a chunk budget, or
N prefill : M decode instances) whose steady-state attainment meets the target at that rate,
each with the resource that binds first above it and its headroom (goodput / rate - 1).
The simulator is the oracle (DistServe-style placement search)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from splitserve.goodput import SLO
from splitserve.sim.deployment import Deployment
from splitserve.sim.metrics import WorkloadFactory
from splitserve.sim.steady import Estimate, SteadyState, estimate, search_goodput

_ITL_KEYS = ("tpot", "gap", "p99_itl")
KV_BLOCKED = 0.05  # a pool whose requests wait for KV memory this much of the time is memory-bound


class Plan(NamedTuple):
    deployment: Deployment
    at_rate: Estimate  # steady-state attainment at the asked rate
    goodput: float  # highest rate still meeting the target (bisected)
    headroom: float  # goodput / rate - 1
    binding: str  # the resource that gives out first above the goodput

    def counts(self) -> dict[str, int]:
        """Instances of each kind, as `--json` prints them (no sim workload has images yet,
        so the encoder pool is always 0)."""
        dep = self.deployment
        if dep.mode == "collocated":
            return {"prefill": 0, "decode": 0, "collocated": dep.replicas, "encoder": 0}
        return {
            "prefill": dep.prefill_instances,
            "decode": dep.decode_instances,
            "collocated": 0,
            "encoder": 0,
        }


def layouts(base: Deployment, gpus: int, tps: Sequence[int], budgets: Sequence[int]) -> list[Deployment]:
    """Every layout that uses exactly `gpus` GPUs."""
    out: list[Deployment] = []
    for tp in tps:
        if gpus % tp == 0:
            for budget in budgets:
                sched = base.sched.with_budget(budget)
                out.append(replace(base, mode="collocated", tp=tp, replicas=gpus // tp, sched=sched))
    for tp_p in tps:
        for tp_d in tps:
            for x in range(1, gpus // tp_p + 1):
                rest = gpus - x * tp_p
                if rest >= tp_d and rest % tp_d == 0:
                    out.append(
                        replace(
                            base,
                            mode="pd",
                            tp_prefill=tp_p,
                            tp_decode=tp_d,
                            prefill_instances=x,
                            decode_instances=rest // tp_d,
                        )
                    )
    return out


def prefill_capacity(dep: Deployment, prompt: int) -> float:
    """Requests/s the prefill side could sustain doing nothing else (an upper bound)."""
    if dep.mode == "collocated":
        rl, count = dep.roofline(dep.tp), dep.replicas
    else:
        rl, count = dep.roofline(dep.tp_prefill), dep.prefill_instances
    return count / rl.step_s(rl.prefill(prompt))


def binding_resource(dep: Deployment, e: Estimate, ttft_bound: float | None = None) -> str:
    """Name what gives out in a run that misses the target: from which bounds are missed
    and how the pools were loaded. `ttft_bound`: the tightest TTFT bound of the SLOs."""
    r = e.result
    ttft_miss = e.misses.get("ttft", 0.0)
    itl_miss = max((e.misses.get(k, 0.0) for k in _ITL_KEYS), default=0.0)
    blocked = {
        role: [b for b, x in zip(r.kv_blocked, r.roles, strict=True) if x == role] for role in set(r.roles)
    }
    memory = {role: float(np.mean(v)) for role, v in blocked.items()}
    if itl_miss > ttft_miss:
        if dep.mode == "collocated":
            return "ITL target (prefill chunks in decode steps)"
        return "decode bandwidth (batch too large for the ITL target)"
    if memory.get("decode", 0.0) > KV_BLOCKED:
        return "KV memory (decode)"
    if memory.get("both", 0.0) > KV_BLOCKED:
        return "KV memory"
    if ttft_bound is not None and np.percentile(r.ttft, 10) > ttft_bound:
        # even the requests that hardly queued are late: the work itself is too slow
        if dep.mode == "pd" and dep.link.fixed_s is not None:
            return "KV handoff"
        return "prefill compute (a prompt alone takes longer than the TTFT target)"
    return "prefill compute"


def plan_for_rate(
    base: Deployment,
    rate: float,
    make: WorkloadFactory,
    slos: Sequence[SLO],
    prompt_tokens: float,
    max_gpus: int = 8,
    tps: Sequence[int] = (1,),
    budgets: Sequence[int] = (512, 2048, 8192),
    target: float = 0.9,
    cfg: SteadyState = SteadyState(),
    iters: int = 5,
    tick: Callable[[], None] | None = None,
) -> list[Plan]:
    """The layouts with the fewest GPUs (up to `max_gpus`) that meet every SLO for `target`
    of requests at `rate`, best first (most headroom)."""
    ttft_bounds = [s.ttft for s in slos if s.ttft is not None]
    ttft_bound = min(ttft_bounds) if ttft_bounds else None
    for gpus in range(1, max_gpus + 1):
        plans = []
        for dep in layouts(base, gpus, tps, budgets):
            capacity = prefill_capacity(dep, int(prompt_tokens))
            if capacity < rate:
                continue  # the prefill side alone cannot keep up
            at_rate = estimate(dep, make, rate, slos, cfg, target, tick)
            if at_rate.attainment < target:
                continue
            found = search_goodput(
                dep, make, slos, rate, 1.2 * capacity, target, cfg, iters, tick, at_lo=at_rate
            )
            above = found.failing
            binding = (
                binding_resource(dep, above, ttft_bound) if above else "none up to 1.2x prefill capacity"
            )
            plans.append(Plan(dep, at_rate, found.goodput, found.goodput / rate - 1, binding))
        if plans:
            return sorted(plans, key=lambda p: (-p.headroom, p.deployment.label()))
    return []
