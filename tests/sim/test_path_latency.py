"""The path around the engines (render, proxy, client) and each later token's relay back as
they grow with the requests in flight, fitted from a bench run (sim/path_latency.py), and
the simulator's delays from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from splitserve.bench.runner import RESULT_VERSION
from splitserve.cli import main
from splitserve.sim import Deployment, Workload, load_gpu, load_model, simulate
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.path_latency import PathLatency, fit_path_latency, timed_requests
from splitserve.sim.profile import EngineProfile, load_profile, save_profile
from splitserve.sim.step_model import StepModel
from tests.sim.test_sim_retime import Clock

MODEL, GPU = load_model("Qwen2.5-7B"), load_gpu("L40S")
STEPS = StepModel(0.002, 20e-6, 4e-9, (1, 4, 16), (0.004, 0.006, 0.012), 1e-7, 0.001)


def bench_run(
    fixed_s: float, per_in_flight_s: float, n: int = 60, relay: tuple[float, float] = (0.002, 0.001)
) -> dict:
    """A bench run's JSON: requests 0.1 s apart, each answered in 0.35 s (three or four in
    flight as the next is sent, none at first), whose time to first token is its phases
    the simulator times plus the path's latency at that load, and whose derender and send
    phases are `relay` (fixed, per stream) a token at the streams in flight as its first
    token came."""
    starts = 0.1 * np.arange(n)
    ttfts = 0.024 + fixed_s + per_in_flight_s * np.minimum(np.arange(n), 3)
    requests = []
    for i in range(n):
        timeline = {"render": 0.001, "prefill_queue": 0.004, "prefill": 0.02, "hops": 0.002}
        first = starts[i] + ttfts[i]
        streams = int(np.sum((starts < first) & (starts + 0.35 >= first)))
        per_token = relay[0] + relay[1] * streams
        timeline |= {"decode": 0.1, "derender": 0.8 * per_token * 16, "send": 0.2 * per_token * 16}
        requests.append(
            {
                "start": starts[i],
                "e2e": 0.35,
                "ttft": ttfts[i],
                "output_tokens": 16,
                "error": None,
                "timeline": timeline,
            }
        )
    requests.append({"start": 0.05, "e2e": None, "ttft": None, "error": "HTTP 503", "timeline": None})
    return {"version": RESULT_VERSION, "levels": [{"load": {"rate": 10.0}, "requests": requests}]}


def test_the_path_is_the_time_to_first_token_less_the_simulated_phases_fitted_on_the_load():
    run = bench_run(0.012, 0.003)
    timed = timed_requests(run)
    assert len(timed) == 60 and [t.in_flight for t in timed[:5]] == [0, 1, 2, 3, 3]
    assert timed[0].path_s == pytest.approx(0.012)
    # the streams as each first token came, itself included, and its way back per token
    assert [t.streams for t in timed[:5]] == [1, 2, 3, 4, 4]
    assert [t.relay_s for t in timed[:2]] == pytest.approx([0.003, 0.004])
    path = fit_path_latency(run)
    assert (path.fixed_s, path.per_in_flight_s) == pytest.approx((0.012, 0.003))
    assert (path.relay_fixed_s, path.relay_per_in_flight_s) == pytest.approx((0.002, 0.001))
    assert path.requests == 60 and path.delay_s(10) == pytest.approx(0.042)
    # a path that does not grow with the load: its mean, no slope
    flat = fit_path_latency(bench_run(0.02, 0.0, relay=(0.003, 0.0)))
    assert (flat.fixed_s, flat.per_in_flight_s) == pytest.approx((0.02, 0.0), abs=1e-12)
    assert (flat.relay_fixed_s, flat.relay_per_in_flight_s) == pytest.approx((0.003, 0.0), abs=1e-12)
    with pytest.raises(ValueError, match=r"5 request\(s\) with the server's timeline \(at least 20"):
        fit_path_latency(bench_run(0.01, 0.0, n=5))
    with pytest.raises(ValueError, match="not a `splitserve bench --json` run"):
        fit_path_latency({"levels": [{"requests": [{"ttft": 0.1}]}]})


def test_the_simulator_delays_each_request_by_the_path_at_the_load_it_arrives_at():
    dep = Deployment(MODEL, GPU, replicas=2, routing="least_loaded", steps=STEPS)
    two = Workload.open_loop([0.0, 0.001], [256, 256], [16, 16])
    base = simulate(dep, two)
    delayed = simulate(replace(dep, path=PathLatency(0.01, 0.005, 0.0, 0.0, 100)), two)
    # the first arrives to none in flight; the second to one, on the other (idle) engine
    assert delayed.ttft[0] == pytest.approx(base.ttft[0] + 0.01, rel=1e-9)
    assert delayed.ttft[1] == pytest.approx(base.ttft[1] + 0.015, rel=1e-9)
    assert np.array(delayed.gaps[0]) == pytest.approx(np.array(base.gaps[0]))


def test_each_later_token_leaves_after_the_one_before_it_through_the_relay():
    dep = Deployment(MODEL, GPU, steps=STEPS)
    one = Workload.open_loop([0.0], [256], [16])
    base = simulate(dep, one)
    engine_gaps = np.array(base.gaps[0])
    assert engine_gaps.min() > 0.004  # the engine's one-token steps

    def relayed(relay_fixed_s: float, relay_per_in_flight_s: float, seed: int = 0):
        return simulate(
            replace(dep, path=PathLatency(0.0, 0.0, relay_fixed_s, relay_per_in_flight_s, 60)), one, seed
        )

    # a fixed relay shorter than the engine's gaps delays every token alike: the gaps stay
    short = relayed(0.001, 0.0)
    assert np.array(short.gaps[0]) == pytest.approx(engine_gaps)
    assert short.ttft[0] == pytest.approx(base.ttft[0])  # the path holds the first token's way back
    # one longer than them sets the pace: each token waits for the one before it
    slow = relayed(0.02, 0.0)
    assert np.array(slow.gaps[0]) == pytest.approx(np.full(15, 0.02))
    assert slow.ttft[0] == pytest.approx(base.ttft[0])
    assert slow.e2e[0] == pytest.approx(base.ttft[0] + 15 * 0.02)
    assert slow.worst_gap[0] == pytest.approx(0.02)
    # a random wait (one stream in flight: its own) spreads the gaps, drawn by the seed
    spread = relayed(0.0, 0.004, seed=1)
    gaps = np.array(spread.gaps[0])
    assert np.all(gaps >= 0) and np.std(gaps) > 2 * np.std(engine_gaps)
    assert spread.e2e[0] >= base.e2e[0]  # a token is never delivered before it is emitted
    assert np.array(relayed(0.0, 0.004, seed=1).gaps[0]) == pytest.approx(gaps)
    assert np.array(relayed(0.0, 0.004, seed=2).gaps[0]) != pytest.approx(gaps)


def test_sim_retime_fits_the_path_from_a_bench_run_and_refuses_one_it_cannot_use(tmp_path: Path, capsys):
    clock = Clock()
    for i in range(12):
        clock.step(float(STEPS.decode_s(1, 300 + i)), decodes=1, context=300 + i)
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(r._asdict()) + "\n" for r in clock.records))
    profile, out, run = tmp_path / "profile.json", tmp_path / "retimed.json", tmp_path / "run.json"
    save_profile(EngineProfile(STEPS, threads=1), str(profile))
    run.write_text(json.dumps(bench_run(0.012, 0.003)))
    args = ["sim", "retime", "--profile", str(profile), "--step-log", str(log), "--out", str(out)]
    assert main([*args, "--bench", str(run)]) == 0
    assert (
        "path to the engines and back: 12.00 ms + 3.000 ms per request in flight; "
        "each later token's relay 2.00 ms + 1.000 ms per stream (60 requests)"
    ) in capsys.readouterr().out
    assert load_profile(str(out)).path == pytest.approx((0.012, 0.003, 0.002, 0.001, 60))
    run.write_text(json.dumps(bench_run(0.012, 0.003, n=3)))
    assert main([*args, "--bench", str(run)]) == 2
    assert f"--bench {run}: 3 request(s) with the server's timeline" in capsys.readouterr().err
    run.write_text("{")
    assert main([*args, "--bench", str(run)]) == 2
    assert f"--bench {run}: {run} is not JSON" in capsys.readouterr().err
    run.write_text(json.dumps({"levels": []}))
    assert main([*args, "--bench", str(run)]) == 2
    assert "is not a `splitserve bench --json` results file" in capsys.readouterr().err
    # a profile's path that is not one is refused by name
    doc = json.loads(out.read_text())
    doc["sim"]["path"]["per_in_flight_s"] = "fast"
    out.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=r"sim.path: every field must be a number >= 0"):
        load_profile(str(out))
