"""Where the simulator runs the tiers' CPU (the render tier, the proxy, a client on the same
host): on an idle engine's cores first, which run it before that engine's next step; with
every engine busy, beside each in proportion to how idle it has been (simulator.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from splitserve.sim import Deployment, KVLink, Workload, load_gpu, load_model, simulate
from splitserve.sim.profile import CpuCosts

MODEL, GPU = load_model("Qwen2.5-7B"), load_gpu("L40S")


def test_a_streaming_engine_pays_its_tiers_cpu_only_when_no_other_engine_is_idle():
    one = Workload.open_loop([0.0], [256], [64])
    alone = Deployment(MODEL, GPU, replicas=1, routing="least_loaded", cpu=CpuCosts())
    base = np.median(simulate(alone, one).gaps[0])
    streaming = replace(alone, cpu=CpuCosts(cpu_s_per_token=0.001))
    assert np.median(simulate(streaming, one).gaps[0]) == pytest.approx(base + 0.001, abs=1e-9)
    # a second engine, idle: its cores run the streams' tiers CPU
    assert np.median(simulate(replace(streaming, replicas=2), one).gaps[0]) == pytest.approx(base, abs=1e-9)
    # on two threads the engine loses two seconds a second (host_planner: own_loss = k)
    doubled = simulate(replace(streaming, own_loss=2.0), one)
    assert np.median(doubled.gaps[0]) == pytest.approx(base + 0.002, abs=1e-9)


def test_what_an_idle_engine_was_left_runs_before_its_next_step_less_what_it_ran_idle():
    """Request 0's 0.2 s of the tiers' CPU goes to the idle second engine, which has run
    0.05 s of it when request 1 arrives there: its prompt step pays the 0.15 s left, and
    request 1's own 0.2 s nearly all (engine 0 has been busy throughout)."""
    wl = Workload.open_loop([0.0, 0.05], [256, 256], [2000, 8])
    dep = Deployment(MODEL, GPU, replicas=2, routing="least_loaded", cpu=CpuCosts())
    base = simulate(dep, wl)
    tiers = simulate(replace(dep, cpu=CpuCosts(cpu_s_per_request=0.2)), wl)
    assert tiers.ttft[0] == pytest.approx(base.ttft[0], abs=1e-9)
    assert tiers.ttft[1] == pytest.approx(base.ttft[1] + 0.15 + 0.2, abs=1e-3)


def test_with_both_engines_busy_the_tiers_cpu_goes_mostly_beside_the_one_idle_longer():
    """1P+1D, request 1 arriving while request 0 decodes (decode busy nearly throughout,
    the prefill worker idle since request 0's prompt): the 0.05 s the tiers spend on request
    1 splits between the two cores by those idle shares, most lengthening request 1's prompt
    step and the rest a decode step; at request 0's arrival both were idle, so decode's
    core ran it from then and request 0's first decode step waited for what was left."""
    wl = Workload.open_loop([0.0, 0.5], [256, 256], [256, 8])
    dep = Deployment(MODEL, GPU, mode="pd", link=KVLink(fixed_s=0.01), cpu=CpuCosts())
    base = simulate(dep, wl)
    tiers = simulate(replace(dep, cpu=CpuCosts(cpu_s_per_remote_request=0.05)), wl)
    (prefill_base, decode_base), (prefill, decode) = base.steps, tiers.steps
    on_prefill = prefill.lengths[1] - prefill_base.lengths[1]
    on_decode = tiers.worst_gap[0] - base.worst_gap[0]
    assert on_prefill + on_decode == pytest.approx(0.05, abs=1e-5)
    assert 0.9 * 0.05 < on_prefill < 0.05
    decode_start = decode_base.ends[0] - decode_base.lengths[0]
    assert decode.lengths[0] - decode_base.lengths[0] == pytest.approx(0.05 - decode_start, abs=1e-9)
