"""The planner answers "how many of each for this rate" in steady state: its estimates
agree with long direct simulations and with queueing theory, and it names what binds."""

from __future__ import annotations

import heapq
import random
from dataclasses import replace

import numpy as np
import pytest

from splitserve.config import SchedulerConfig
from splitserve.goodput import SLO, arrival_times
from splitserve.sim import (
    Deployment,
    Efficiency,
    InstanceConfig,
    KVLink,
    Roofline,
    SteadyState,
    estimate,
    load_gpu,
    load_model,
    search_goodput,
    simulate,
    synthetic,
)
from splitserve.sim.metrics import met
from splitserve.sim.planner import binding_resource, layouts, plan_for_rate, prefill_capacity

MODEL, GPU = load_model("Qwen2.5-7B"), load_gpu("L40S")
# the realistic preset: per-kernel step times, small-chunk efficiency, several prompts per
# step, prefill instances chunking too, KV memory, least-loaded routing
REALISTIC = Deployment(
    MODEL,
    GPU,
    eff=Efficiency(small_chunk_tokens=128),
    combine="sum",
    sched=InstanceConfig(SchedulerConfig()),
    prefill_sched=InstanceConfig(SchedulerConfig()),
    routing="least_loaded",
    kv_limit=True,
    link=KVLink(fixed_s=0.02),
)


def short(rate: float, n: int, seed: int):
    return synthetic(rate, n, 2048, 64, seed=seed)


def guide(rate: float, n: int, seed: int):
    return synthetic(rate, n, 8192, 256, seed=seed)


def long_run_attainment(dep: Deployment, make, rate: float, slo: SLO, n: int = 8000, seed: int = 1) -> float:
    """A direct simulation, long, from another seed; the middle 75% of requests."""
    r = simulate(dep, make(rate, n, seed), seed=seed)
    return float(met(slo, r)[n // 5 : n - n // 20].mean())


def test_plan_matches_long_direct_simulations():
    slo = SLO(ttft=0.5, gap=0.1)
    plans = plan_for_rate(REALISTIC, 3.0, short, [slo], 2048, max_gpus=4, budgets=(512, 2048), iters=3)
    best = plans[0].deployment
    assert best.gpus == 2 and best.label() == "2x collocated TP1 (budget 512)"
    assert long_run_attainment(best, short, 3.0, slo) >= 0.9 - 0.02
    for gpus in range(1, best.gpus):  # nothing cheaper meets it
        for dep in layouts(REALISTIC, gpus, (1,), (512, 2048)):
            assert long_run_attainment(dep, short, 3.0, slo) < 0.9, dep.label()
    chosen = {p.deployment.label() for p in plans}
    for dep in layouts(REALISTIC, best.gpus, (1,), (512, 2048)):
        if dep.label() not in chosen:  # not recommended: not clearly meeting it either
            assert long_run_attainment(dep, short, 3.0, slo) < 0.9 + 0.02, dep.label()
    assert plans[0].goodput >= 3.0 and plans[0].headroom == pytest.approx(plans[0].goodput / 3.0 - 1)


def test_steady_state_does_not_depend_on_run_length():
    """Runs that start empty are optimistic at high load: 200 requests say more meet the SLO
    than the steady state does (the issue: 91% over 200 requests, 64% over 3,000); the
    steady estimate agrees with a run twice as long."""
    dep = replace(REALISTIC, sched=REALISTIC.sched.with_budget(512))
    slo = SLO(ttft=2.0, gap=0.1)
    cfg = SteadyState(max_requests=1600)
    e = estimate(dep, guide, 1.7, [slo], cfg)
    first_200 = float(met(slo, simulate(dep, guide(1.7, 200, 0))).mean())
    assert first_200 > e.attainment + 0.2
    longer = long_run_attainment(dep, guide, 1.7, slo, n=2 * e.requests, seed=0)
    assert abs(longer - e.attainment) <= e.half_width + 0.03
    assert e.half_width <= cfg.half_width or e.requests == cfg.max_requests


def queue_goodput(servers: int, service_s: float, budget_s: float, n: int = 20_000) -> float:
    """Independent oracle: an M/D/c queue (FCFS, Poisson arrivals, deterministic service);
    the highest rate at which 90% of requests finish within `budget_s`, by bisection."""

    def fraction_within(rate: float) -> float:
        free = [0.0] * servers
        within = []
        for i, t in enumerate(arrival_times(rate, n, seed=0)):
            start = max(t, heapq.heappop(free))
            heapq.heappush(free, start + service_s)
            if i >= n // 5:
                within.append(start + service_s - t <= budget_s)
        return sum(within) / len(within)

    lo, hi = 0.01, servers / service_s
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fraction_within(mid) >= 0.9 else (lo, mid)
    return lo


@pytest.mark.parametrize(("prefills", "issue_figure"), [(1, 0.77), (2, 2.1), (3, 3.45)])
def test_prefill_queue_goodput_matches_queueing_theory(prefills, issue_figure):
    """A queue of 0.71 s prefills meets "90% TTFT <= 2 s" up to 0.77 / 2.1 / 3.45 req/s for
    1 / 2 / 3 prefill GPUs (the issue's long simulations); the old planner was 14-21% high."""
    seed_model = Deployment(
        MODEL, GPU, mode="pd", prefill_instances=prefills, decode_instances=3, link=KVLink(fixed_s=0.0)
    )
    rl = Roofline(MODEL, GPU)
    first_decode = rl.step_s(rl.decode(1, 8192))
    oracle = queue_goodput(prefills, rl.step_s(rl.prefill(8192)), 2.0 - first_decode)
    cap = prefill_capacity(seed_model, 8192)
    found = search_goodput(seed_model, guide, [SLO(ttft=2.0)], cap / 4, cap, iters=7)
    assert found.goodput == pytest.approx(oracle, rel=0.04)
    assert found.goodput == pytest.approx(issue_figure, rel=0.05)


def test_binding_resource_is_named():
    """3P:1D at 4 req/s: the prefill side keeps up, decode's KV memory does not (the old
    planner said "prefill capacity" and recommended it); 4P:2D meets the SLO."""
    slo = [SLO(ttft=2.0, gap=0.1)]
    tight = replace(REALISTIC, mode="pd", prefill_instances=3, decode_instances=1)
    e = estimate(tight, guide, 4.0, slo, SteadyState(max_requests=1600), target=0.9)
    assert e.attainment < 0.5 and binding_resource(tight, e) == "KV memory (decode)"
    roomy = replace(tight, prefill_instances=4, decode_instances=2)
    assert estimate(roomy, guide, 4.0, slo, SteadyState(max_requests=1600), target=0.9).attainment >= 0.9
    queue = replace(tight, prefill_instances=1, decode_instances=2)
    e = estimate(queue, guide, 1.6, slo, SteadyState(max_requests=1600), target=0.9)
    assert binding_resource(queue, e) == "prefill compute"
    col = replace(REALISTIC, sched=REALISTIC.sched.with_budget(2048))
    e = estimate(col, guide, 0.4, slo, SteadyState(max_requests=1600), target=0.9)
    assert e.attainment < 0.9 and binding_resource(col, e).startswith("ITL target")


def test_same_seed_same_requests_across_designs():
    """Common random numbers: every design sees the same arrivals; a longer run of a seed
    extends the shorter one."""
    a, b = guide(1.0, 400, 0), guide(1.0, 800, 0)
    assert np.array_equal(a.arrival, b.arrival[:400]) and np.array_equal(a.prompt, b.prompt[:400])
    varied_a, varied_b = (
        synthetic(1.0, 50, "uniform:100:900", "exp:50", seed=2),
        synthetic(1.0, 100, "uniform:100:900", "exp:50", seed=2),
    )
    assert np.array_equal(varied_a.prompt, varied_b.prompt[:50])
    assert np.array_equal(varied_a.output, varied_b.output[:50])
    assert random.Random(0).expovariate(1.0) == a.arrival[0]
