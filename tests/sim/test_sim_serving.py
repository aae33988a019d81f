"""The seed's simulated tables, reproduced by splitserve's simulator within a stated tolerance,
and compared with the guide's measurements (errors stated in the assertions and docs/sim.md).

Why not exact: the seed draws Poisson arrivals with Python's `random`, we draw them with
numpy, so each seed's 100 arrival times differ; 5-seed means agree within a few percent
below saturation and within ~25% near it (where 100 requests are a noisy sample)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from splitserve.sim import (
    SLO_AVERAGE,
    SLO_WORST_GAP,
    Deployment,
    SchedulerConfig,
    TransferConfig,
    goodput,
    load_gpu,
    load_model,
    simulate,
    synthetic,
)

MODEL, GPU = load_model("Qwen2.5-7B"), load_gpu("L40S")
COLLOCATED = Deployment(MODEL, GPU)
PD_SLOW = Deployment(MODEL, GPU, mode="pd", transfer=TransferConfig(fixed_s=1.3))
PD_FAST = Deployment(MODEL, GPU, mode="pd", transfer=TransferConfig(fixed_s=0.02))
RATES = [0.2, 0.4, 0.6, 1.0, 2.0]


def make(rate: float, seed: int):
    return synthetic(rate, 100, 8192, 256, seed=seed)


def mean_summary(dep: Deployment, rate: float, seeds: int = 5) -> dict[str, float]:
    runs = [simulate(dep, make(rate, s), seed=s).summary() for s in range(seeds)]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, float], dict[str, float]]:
    designs = {"collocated": COLLOCATED, "pd1.3": PD_SLOW, "pd0.02": PD_FAST}
    return {(name, rate): mean_summary(dep, rate) for name, dep in designs.items() for rate in RATES}


# the seed's serving_sim table: (median TTFT s, ITL p50 ms, ITL p99 ms)
SEED = {
    ("collocated", 0.2): (0.72, 25, 26),
    ("collocated", 0.4): (0.75, 25, 174),
    ("collocated", 0.6): (0.75, 26, 184),
    ("collocated", 1.0): (0.76, 28, 194),
    ("collocated", 2.0): (0.83, 37, 194),
    ("pd1.3", 0.2): (2.04, 25, 27),
    ("pd1.3", 0.4): (2.05, 26, 29),
    ("pd1.3", 0.6): (2.06, 27, 30),
    ("pd1.3", 1.0): (2.28, 29, 32),
    ("pd1.3", 2.0): (10.45, 33, 33),
    ("pd0.02", 0.2): (0.76, 25, 27),
    ("pd0.02", 0.4): (0.77, 26, 29),
    ("pd0.02", 0.6): (0.78, 27, 30),
    ("pd0.02", 1.0): (1.00, 29, 32),
    ("pd0.02", 2.0): (9.17, 33, 33),
}


def test_seed_serving_table_within_tolerance(table):
    for key, (ttft, p50, p99) in SEED.items():
        got = table[key]
        near_saturation = key[0] != "collocated" and key[1] >= 1.0
        ttft_tol = 0.30 if near_saturation else 0.05
        assert got["ttft_median_s"] == pytest.approx(ttft, rel=ttft_tol), key
        assert got["itl_p50_s"] * 1e3 == pytest.approx(p50, rel=0.06, abs=1.0), key
        assert got["itl_p99_s"] * 1e3 == pytest.approx(p99, rel=0.06, abs=1.0), key


def test_collocated_tail_switches_to_one_chunk(table):
    """p99 ITL jumps from one decode step (~26 ms) to one 2,048-token chunk (~170-194 ms)."""
    assert table[("collocated", 0.2)]["itl_p99_s"] < 0.030
    assert 0.160 <= table[("collocated", 0.4)]["itl_p99_s"] <= 0.190
    assert table[("collocated", 1.0)]["itl_p99_s"] == pytest.approx(0.194, abs=0.002)


def test_pd_tails_flat_and_slow_handoff_ttft(table):
    for name in ("pd1.3", "pd0.02"):
        p99s = [table[(name, r)]["itl_p99_s"] for r in RATES]
        assert max(p99s) - min(p99s) < 0.010 and max(p99s) < 0.035, (name, p99s)
    # 1.3 s handoff: every first token just after 2 s, against ~0.75 s collocated
    for rate in (0.2, 0.4, 0.6):
        assert 2.0 <= table[("pd1.3", rate)]["ttft_median_s"] <= 2.1
    # one prefill GPU saturates at ~1.4 req/s: TTFT explodes beyond, even with a fast handoff
    assert table[("pd0.02", 2.0)]["ttft_median_s"] > 5.0


def test_against_the_guides_measurements(table):
    """The guide measured (same model, GPUs, workload): collocated p99 ITL 169 ms at 0.4 req/s,
    median TTFT ~0.7 s and median ITL 21-24 ms at low load, P/D median TTFT 2.2 s with its
    1.3 s handoff, P/D p99 ITL 25-52 ms. Errors: +5%, +3%, +4% above the range, -7%, inside."""
    p99 = table[("collocated", 0.4)]["itl_p99_s"]
    assert abs(p99 / 0.169 - 1) < 0.10, f"p99 ITL {p99 * 1e3:.0f} ms vs 169 ms"
    ttft = table[("collocated", 0.2)]["ttft_median_s"]
    assert abs(ttft / 0.7 - 1) < 0.06, f"median TTFT {ttft:.2f} s vs ~0.7 s"
    itl = table[("collocated", 0.2)]["itl_p50_s"]
    assert 0.021 <= itl <= 0.024 * 1.08, f"median ITL {itl * 1e3:.1f} ms vs 21-24 ms"
    pd_ttft = table[("pd1.3", 0.2)]["ttft_median_s"]
    assert abs(pd_ttft / 2.2 - 1) < 0.10, f"P/D TTFT {pd_ttft:.2f} s vs 2.2 s"
    for rate in RATES:
        assert 0.025 <= table[("pd0.02", rate)]["itl_p99_s"] <= 0.052


def test_goodput_table():
    """The seed's goodput table: 7 rates x 5 seeds x 3 designs, twice (two SLOs). (Its speed is
    measured in benchmarks/bench_sim_goodput.py.)"""
    rates = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5]
    res = {
        (slo_name, name): goodput(dep, make, slo, rates, target=0.9, seeds=5)
        for slo_name, slo in (("A", SLO_AVERAGE), ("B", SLO_WORST_GAP))
        for name, dep in (("collocated", COLLOCATED), ("pd1.3", PD_SLOW), ("pd0.02", PD_FAST))
    }
    assert res[("A", "collocated")].goodput == 0.2
    assert res[("A", "pd0.02")].goodput == 0.6
    assert res[("A", "pd1.3")].goodput == res[("B", "pd1.3")].goodput == 0.0
    assert res[("B", "collocated")].goodput == 0.0
    assert res[("B", "pd0.02")].goodput == 0.8
    seed_a_col = [0.97, 0.75, 0.46, 0.23, 0.10, 0.05, 0.03]
    seed_b_col = [0.65, 0.29, 0.11, 0.05, 0.03, 0.02, 0.02]
    for got, want in zip(res[("A", "collocated")].points, seed_a_col, strict=True):
        assert got.attainment == pytest.approx(want, abs=0.10)
    for got, want in zip(res[("B", "collocated")].points, seed_b_col, strict=True):
        assert got.attainment == pytest.approx(want, abs=0.10)
    assert all(p.attainment == 0.0 for p in res[("A", "pd1.3")].points)


def test_chunk_sweep_worst_gap_is_one_chunk():
    expected_ms = {512: 51, 1024: 99, 2048: 194, 4096: 376, 8192: 710}
    for budget, ms in expected_ms.items():
        dep = replace(COLLOCATED, sched=SchedulerConfig(budget=budget))
        worst = np.mean([simulate(dep, make(1.0, s)).worst_gap.max() for s in range(2)])
        assert worst * 1e3 == pytest.approx(ms, abs=2), budget
    # no chunking: its 710 ms stalls hide below the p99 at 0.4 req/s, dominate it at 1.0
    whole = replace(COLLOCATED, sched=SchedulerConfig(budget=8192))
    assert mean_summary(whole, 0.4)["itl_p99_s"] < 0.060
    assert mean_summary(whole, 1.0)["itl_p99_s"] == pytest.approx(0.710, abs=0.005)
