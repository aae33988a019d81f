"""The host planner's layouts (`up --plan`): every engine count up to the cores, each engine on
its own even share, pinned unless one engine has them all; and an engine's profiled step
times on fewer cores than it was measured on."""

from __future__ import annotations

import pytest

from splitserve.config import SchedulerConfig
from splitserve.sim.host_planner import (
    HostLayout,
    host_deployment,
    host_layouts,
    layout_deployment,
    steps_on_cores,
)
from splitserve.sim.profile import EngineProfile
from splitserve.sim.specs import load_model
from splitserve.sim.step_model import StepModel


def test_layouts_split_the_cores_evenly_and_pin_each_engine():
    layouts = host_layouts([3, 2, 1, 0], max_engines=3)
    assert [(layout.prefill, layout.decode) for layout in layouts] == [
        (0, 1), (0, 2), (1, 1), (0, 3), (1, 2), (2, 1),
    ]  # fmt: skip
    one, two_decode, pd, *_, three = layouts
    assert one.cpu_affinity([0, 1, 2, 3]) == [] and one.label() == "1 decode (serve-like)"
    assert two_decode.cpu_affinity([0, 1, 2, 3]) == ["decode-0=0,1", "decode-1=2,3"]
    assert pd.cpu_affinity([0, 1, 2, 3]) == ["prefill-0=0,1", "decode-0=2,3"]
    assert pd.label() == "1 prefill + 1 decode"
    # 4 cores over 3 engines: one each, the fourth left to the render tier and the proxy
    assert three.cpu_affinity([0, 1, 2, 3]) == ["prefill-0=0", "prefill-1=1", "decode-0=2"]
    assert len(host_layouts([0, 1], max_engines=8)) == 3  # at most one engine per core
    with pytest.raises(ValueError, match="no CPUs"):
        host_layouts([])


def test_fewer_cores_slow_the_token_work_and_not_the_fixed_costs():
    steps = StepModel(0.002, 20e-6, 4e-9, (1, 16), (0.004, 0.012), 1e-7)
    half = steps_on_cores(steps, measured_cores=4, cores=2)
    assert half.prefill_s(200) - half.prefill_fixed_s == pytest.approx(2 * (steps.prefill_s(200) - 0.002))
    assert half.prefill_fixed_s == steps.prefill_fixed_s and half.decode_base_s == steps.decode_base_s
    assert float(half.decode_s(1, 1000)) == pytest.approx(0.004 + 2e-4)
    assert steps_on_cores(steps, 4, 4) == steps


def test_a_pd_layout_decides_on_its_own_prefill_workers_cost_per_token():
    """`up`'s proxy decides on a prefill worker's step time over its tokens (router/pd_costs.py):
    a layout of one-core engines on the one-core steps, whatever the profile's engines were;
    the profile's handoff stays."""
    two = StepModel(0.004, 40e-6, 1e-7, (1, 16), (0.003, 0.006), 1e-6)
    one = StepModel(0.008, 80e-6, 3e-7, (1, 16), (0.006, 0.012), 1e-6)
    profile = EngineProfile(two, handoff_fixed_s=0.03, threads=2, other_steps={1: one})
    base = host_deployment(load_model("Qwen2.5-7B"), profile, SchedulerConfig())
    assert base.pd_costs.prefill_s_per_token == pytest.approx(40e-6 + 1e-7 * 256)  # the profile's
    pd = layout_deployment(base, HostLayout(1, 1, ((0,), (1,))), 2, profile.measured_steps())
    assert pd.pd_costs.prefill_s_per_token == pytest.approx(one.prefill_s(256) / 256)
    assert pd.pd_costs.decode_prefill_s_per_token == pd.pd_costs.prefill_s_per_token
    assert pd.pd_costs.handoff_fixed_s == 0.03
    collocated = layout_deployment(base, HostLayout(0, 1, ((0, 1),)), 2, profile.measured_steps())
    assert collocated.pd_costs == base.pd_costs  # no proxy decision to make
