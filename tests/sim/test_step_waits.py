"""The steps' waits for a core, fitted from a layout's step logs (sim/step_waits.py), and
the simulator putting them beside its steps instead of placing the tiers' CPU itself."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from splitserve.protocol.step_record import StepRecord
from splitserve.sim import Deployment, Workload, load_gpu, load_model, simulate
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.profile import CpuCosts, EngineProfile, load_profile, save_profile
from splitserve.sim.step_model import StepModel
from splitserve.sim.step_waits import StepWaits, WaitTerms, fit_step_waits, wait_rows

MODEL, GPU = load_model("Qwen2.5-7B"), load_gpu("L40S")
STEPS = StepModel(0.002, 20e-6, 4e-9, (1, 4, 16), (0.004, 0.006, 0.012), 1e-7, 0.001)


class Engine:
    """Step records of one engine process: its thread's CPU grows by each step's compute,
    and its wall time is the compute and the wait."""

    def __init__(self, pid: int, role: str) -> None:
        self.pid, self.role, self.cpu, self.t = pid, role, 0.0, 0.0
        self.records = [self.record(0.0, 0.0, 0, 0)]

    def record(self, compute: float, wait: float, decodes: int, chunks: int) -> StepRecord:
        self.cpu += compute
        self.t += compute + wait
        shape = tuple((64, 0) for _ in range(chunks))
        tokens = decodes + 64 * chunks
        return StepRecord(self.pid, self.role, self.t, compute + wait, tokens, decodes, self.cpu, wait,
                          decodes, 300 * decodes, shape, 1, False)  # fmt: skip

    def step(self, compute: float, wait: float, decodes: int = 0, chunks: int = 0) -> tuple[float, float]:
        start = self.t
        self.records.append(self.record(compute, wait, decodes, chunks))
        return start, self.t

    def idle(self, seconds: float) -> None:
        self.t += seconds


def decode_wait(compute: float, decodes: int, chunks: int, stepping: bool) -> float:
    if stepping:  # beside a busy prefill worker: its own streams' CPU and a share of time
        return 0.1 * compute + 0.0005 * decodes + 0.002 * chunks
    return 0.02 * compute


def one_p_one_d() -> tuple[Engine, Engine]:
    """A prefill worker that idles 30 ms between its steps (its wait 0.6 s per second of
    compute), and a decode worker stepping throughout, its batch moving 1..8."""
    prefill, decode = Engine(1, "prefill"), Engine(2, "decode")
    rng = np.random.default_rng(0)
    while prefill.t < 3.0:
        prefill.idle(0.030)
        compute = float(rng.uniform(0.01, 0.03))
        prefill.step(compute, 0.6 * compute, chunks=1)
    spans = [(a.t - a.step_s, a.t) for a in prefill.records[1:]]
    while decode.t < 3.0:
        batch = int(rng.integers(1, 9))
        chunks = int(rng.integers(0, 2))
        compute = 0.004 + 0.0005 * batch + 0.003 * chunks
        stepping = any(a <= decode.t < b for a, b in spans)
        decode.step(compute, decode_wait(compute, batch, chunks, stepping), decodes=batch, chunks=chunks)
    return prefill, decode


def test_the_waits_are_fitted_per_kind_of_engine_and_whether_another_was_stepping():
    prefill, decode = one_p_one_d()
    waits = fit_step_waits(prefill.records + decode.records, lambda r: None)
    assert waits is not None and set(waits.kinds) == {"prefill", "decode"}
    idle, stepping = waits.kinds["decode"]
    assert idle.per_compute == pytest.approx(0.02, abs=1e-6)
    assert (idle.per_decode_s, idle.per_chunk_s) == pytest.approx((0.0, 0.0), abs=1e-9)
    assert stepping.per_compute == pytest.approx(0.1, abs=1e-6)
    assert stepping.per_decode_s == pytest.approx(0.0005, abs=1e-8)
    assert stepping.per_chunk_s == pytest.approx(0.002, abs=1e-8)
    assert idle.steps + stepping.steps == len(decode.records) - 1 and min(idle.steps, stepping.steps) > 100
    # the prefill worker always began beside a stepping decode worker: its idle state,
    # with no steps, takes the fit over all of its steps
    prefill_idle, prefill_stepping = waits.kinds["prefill"]
    assert prefill_stepping.per_compute == pytest.approx(0.6, abs=1e-6)
    assert prefill_idle == prefill_stepping
    assert waits.terms("both", True) == stepping and waits.terms("prefill", False) == prefill_idle
    assert waits.spreads == {}  # no compute model to set the wall times against
    rows = wait_rows(waits)
    assert "decode waits (another stepping): 0.100 s/s of compute + 0.500 ms/decode + 2.000 ms" in rows[1]


def test_a_wait_that_falls_with_a_term_is_not_fitted_a_negative_one():
    engine = Engine(1, "decode")
    rng = np.random.default_rng(1)
    for _ in range(100):
        batch, compute = int(rng.integers(1, 9)), float(rng.uniform(0.005, 0.02))
        engine.step(compute, max(0.0, 0.3 * compute - 0.0002 * batch), decodes=batch)
    (idle, _) = fit_step_waits(engine.records, lambda r: None).kinds["decode"]
    assert (idle.per_decode_s, idle.per_chunk_s) == (0.0, 0.0)
    assert 0.15 < idle.per_compute < 0.3


def test_the_spread_is_the_logged_over_the_predicted_wall_times_with_their_totals_mean():
    engine = Engine(1, "decode")
    for i in range(200):  # one-token steps as modelled, four-token ones half as long again
        engine.step(0.005 if i % 2 else 0.015, 0.0, decodes=1 if i % 2 else 4)
    waits = fit_step_waits(engine.records, lambda r: 0.005 if r.decodes == 1 else 0.010)
    spread = np.array(waits.spread("decode"))
    # not 1 (the mean of the ratios would be 1.25): the logged steps' total over the predicted
    assert spread.mean() == pytest.approx(0.020 / 0.015, rel=0.01)
    assert spread.max() / spread.min() == pytest.approx(1.5, rel=0.01)
    assert np.mean(spread > 1.1 * spread.min()) == pytest.approx(0.5, abs=0.03)
    assert waits.spread("prefill") == ()


def deployment(waits: StepWaits | None, replicas: int = 1) -> Deployment:
    return Deployment(MODEL, GPU, replicas=replicas, routing="least_loaded", steps=STEPS, waits=waits)


def terms(per_compute: float, per_decode_s: float = 0.0, per_chunk_s: float = 0.0) -> WaitTerms:
    return WaitTerms(per_compute, per_decode_s, per_chunk_s, 100)


def test_a_simulated_step_takes_its_compute_and_the_wait_fitted_for_its_state():
    one = Workload.open_loop([0.0], [256], [16])
    base = simulate(deployment(None), one)
    waits = StepWaits({"decode": (terms(0.5, 0.001, 0.01), terms(1.0, 0.002, 0.02))}, {})
    waited = simulate(deployment(waits), one)
    assert waited.ttft[0] == pytest.approx(1.5 * base.ttft[0] + 0.01, rel=1e-9)
    assert np.array(waited.gaps[0]) == pytest.approx(1.5 * np.array(base.gaps[0]) + 0.001, rel=1e-9)
    # the tiers' CPU is not placed as well: the fitted waits stand for it
    costly = CpuCosts(cpu_s_per_request=0.05, cpu_s_per_token=0.001, engine_s_per_step=0.002)
    assert simulate(replace(deployment(waits), cpu=costly), one).gaps[0] == pytest.approx(waited.gaps[0])
    # a second request that arrives while the first engine steps takes the other state's terms
    two = Workload.open_loop([0.0, 0.001], [256, 256], [16, 16])
    both = simulate(deployment(waits, replicas=2), two)
    alone = simulate(deployment(None, replicas=2), two)
    assert both.ttft[0] == pytest.approx(1.5 * alone.ttft[0] + 0.01, rel=1e-9)
    assert both.ttft[1] == pytest.approx(2.0 * alone.ttft[1] + 0.02, rel=1e-9)


def test_each_simulated_step_is_scaled_by_a_draw_from_the_spread():
    one = Workload.open_loop([0.0], [256], [200])
    flat = StepWaits({"decode": (terms(0.0), terms(0.0))}, {})
    base = np.array(simulate(deployment(flat), one).gaps[0])
    spread = flat._replace(spreads={"decode": (0.5, 1.5)})
    gaps = np.array(simulate(deployment(spread), one, seed=3).gaps[0])
    ratios = np.round(gaps / base, 9)
    assert set(ratios) == {0.5, 1.5} and 0.3 < np.mean(ratios == 1.5) < 0.7
    assert np.array(simulate(deployment(spread), one, seed=3).gaps[0]) == pytest.approx(gaps)


def test_a_profile_keeps_its_waits_and_refuses_bad_ones(tmp_path: Path):
    waits = StepWaits(
        {"decode": (terms(0.1, 0.0005), terms(0.3, 0.001, 0.002)), "prefill": (terms(0.6), terms(0.7))},
        {"decode": (0.8, 1.0, 1.2)},
    )
    path = tmp_path / "profile.json"
    save_profile(EngineProfile(STEPS, threads=1, waits=waits), str(path))
    assert load_profile(str(path)).waits == waits
    doc = json.loads(path.read_text())
    doc["sim"]["waits"]["decode"]["others_idle"]["per_compute"] = -0.1
    path.write_text(json.dumps(doc))
    with pytest.raises(
        CalibrationError, match=r"sim.waits.decode.others_idle: every term must be a number >= 0"
    ):
        load_profile(str(path))
    del doc["sim"]["waits"]["decode"]["others_idle"]
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="needs 'others_idle' and 'others_stepping'"):
        load_profile(str(path))
    doc["sim"]["waits"] = {"encoder": {}}
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="maps 'prefill' and/or 'decode'"):
        load_profile(str(path))
