"""`sim calibrate --pd`: the handoff from first tokens timed alone on both P/D paths."""

import pytest

from splitserve.sim.calibrate import Sample
from splitserve.sim.profile import CpuCosts, build_profile, load_profile, save_profile
from splitserve.sim.step_model import StepModel
from splitserve.sim.tier_probe import handoff_costs

PREFILL = StepModel(0.008, 80e-6, 3e-9, (1, 16), (0.006, 0.012), 1e-6)  # a one-thread prefill worker
KV_BYTES_PER_TOKEN = 4096


def test_the_handoff_is_what_the_remote_path_spends_beyond_its_steps_and_the_local_paths_hops():
    """First tokens, each less the steps it took: a local one is its hops, a remote one its
    hops and the handoff, a fixed part and a part per KV byte."""
    hops, fixed, per_byte = 0.021, 0.012, 2e-10
    remote = {n: hops + fixed + per_byte * n * KV_BYTES_PER_TOKEN for n in (256, 1024, 2048)}
    assert handoff_costs(hops, remote, KV_BYTES_PER_TOKEN) == pytest.approx((fixed, per_byte))
    # the hops are the same on both paths and do not move it
    slower = {n: s + 0.07 for n, s in remote.items()}
    assert handoff_costs(hops + 0.07, slower, KV_BYTES_PER_TOKEN) == pytest.approx((fixed, per_byte))


def test_a_remote_path_no_slower_than_the_local_one_beyond_its_steps_costs_no_handoff():
    remote = {n: 0.017 for n in (256, 1024, 2048)}
    fixed, per_byte = handoff_costs(0.021, remote, KV_BYTES_PER_TOKEN)
    assert fixed == 0.0 and per_byte == pytest.approx(0.0, abs=1e-18)


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
