"""`sim calibrate --pd`: the handoff from first tokens timed alone on both P/D paths."""

import pytest

from splitserve.sim.calibrate import Sample
from splitserve.sim.profile import CpuCosts, build_profile, load_profile, save_profile
from splitserve.sim.step_model import StepModel
from splitserve.sim.tier_probe import handoff_costs

PREFILL = StepModel(0.008, 80e-6, 3e-9, (1, 16), (0.006, 0.012), 1e-6)  # a one-thread prefill worker
DECODE = StepModel(0.007, 70e-6, 2e-9, (1, 16), (0.005, 0.011), 2e-6)
KV_BYTES_PER_TOKEN = 4096


def first_tokens(hops_s: float, fixed_s: float, per_byte_s: float) -> tuple[float, int, dict[int, float]]:
    """First tokens as a P/D stack with these costs serves them: a local one is its hops
    and the decode worker's prefill step; a remote one its hops, the prefill worker's
    step, the handoff and the decode worker's first step over the whole prompt."""
    local = hops_s + DECODE.prefill_s(16)
    remote = {
        n: hops_s
        + PREFILL.prefill_s(n)
        + fixed_s
        + per_byte_s * n * KV_BYTES_PER_TOKEN
        + float(DECODE.decode_s(1, n))
        for n in (256, 1024, 2048)
    }
    return local, 16, remote


def test_the_handoff_is_what_the_remote_path_spends_beyond_both_steps_and_the_local_paths_hops():
    local, _, remote = first_tokens(hops_s=0.021, fixed_s=0.012, per_byte_s=2e-10)
    fixed, per_byte = handoff_costs(local, 16, remote, PREFILL, DECODE, KV_BYTES_PER_TOKEN)
    assert fixed == pytest.approx(0.012) and per_byte == pytest.approx(2e-10)
    # the hops are the same on both paths and do not move it
    slower_hops = handoff_costs(*first_tokens(0.090, 0.012, 2e-10), PREFILL, DECODE, KV_BYTES_PER_TOKEN)
    assert slower_hops == pytest.approx((0.012, 2e-10))


def test_a_remote_path_no_slower_than_its_compute_costs_no_handoff():
    local, _, remote = first_tokens(hops_s=0.021, fixed_s=-0.004, per_byte_s=0.0)
    assert handoff_costs(local, 16, remote, PREFILL, DECODE, KV_BYTES_PER_TOKEN) == (0.0, 0.0)


def test_the_simulators_link_leaves_out_the_engines_own_cpu_the_decision_weighs_all_of_it(tmp_path):
    """The prefill worker's API and KV push and the decode worker's intake of a remote
    request are in its measured handoff, and the simulator also puts them in those engines'
    steps: its link takes the rest; the proxy's decision (`--pd-cost-profile`) the whole."""
    samples = [Sample("prefill", n, 0, PREFILL.prefill_s(n)) for n in (32, 256, 1024)]
    samples += [Sample("decode", b, 64, float(PREFILL.decode_s(b, b * 64))) for b in (1, 16)]
    own = CpuCosts(prefill_engine_s_per_request=0.008, engine_s_per_remote_request=0.004)
    profile = build_profile(samples, "m", "g", own, (0.030, 2e-10), KV_BYTES_PER_TOKEN)
    assert profile.handoff_fixed_s == pytest.approx(0.018) and profile.handoff_s_per_byte == 2e-10
    assert profile.decision_costs().handoff_fixed_s == pytest.approx(0.030)
    save_profile(profile, str(tmp_path / "p.json"))
    again = load_profile(str(tmp_path / "p.json"))
    assert again.handoff_fixed_s == pytest.approx(0.018)
    assert again.decision_costs().handoff_fixed_s == pytest.approx(0.030)
    # an engine's own CPU beyond the whole handoff leaves the link nothing, not less
    assert build_profile(samples, "m", "g", own, (0.010, 0.0)).handoff_fixed_s == 0.0
