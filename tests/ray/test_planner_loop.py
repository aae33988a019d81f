"""`--ray-planner`'s decisions (ray_serve/planner_loop.py) from the traffic the proxy logs
(router/traffic.py): a stepped arrival rate, low, high, low, moves the tiers' targets up at
once and back down within two intervals; no arrivals ask for the lowest bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.goodput import SLO
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.ray_serve.planner_loop import PlannerSettings, TierBounds, fleet_planner
from splitserve.router.traffic import TrafficLog, TrafficWindow
from splitserve.sim.specs import load_model
from tests.deploy.test_up_plan import PROFILE

INTERVAL_S = 10.0
BOUNDS = {"prefill": TierBounds(0, 1), "decode": TierBounds(1, 2)}


def request(i: int, prompt_tokens: int, max_tokens: int) -> GenerateRequest:
    body = {"request_id": f"r{i}", "token_ids": [1] * prompt_tokens}
    return GenerateRequest.from_wire({**body, "sampling_params": {"max_tokens": max_tokens}})


def traffic_at(rate: float, start: float, log: TrafficLog) -> TrafficWindow:
    """`rate` requests a second over one interval from `start`, all of them ended with 16
    output tokens but one still running (counted with its max_tokens)."""
    n = round(rate * INTERVAL_S)
    for i in range(n):
        entry = log.arrived(request(i, 200, 32), now=start + i / max(rate, 1e-9))
        if i:
            entry.saw({"choices": [{"finish_reason": "length"}], "usage": {"completion_tokens": 16}})
    return log.window(INTERVAL_S, now=start + INTERVAL_S)


def test_the_traffic_window_holds_the_intervals_arrivals_and_their_lengths():
    log = TrafficLog()
    window = traffic_at(2.0, 100.0, log)
    assert window.arrivals == 20 and window.rate == pytest.approx(2.0)
    assert window.lengths[0] == (200, 32)  # still running: counted with what it asked for
    assert set(window.lengths[1:]) == {(200, 16)}
    later = log.window(INTERVAL_S, now=100.0 + 3 * INTERVAL_S)
    assert later.arrivals == 0 and later.rate == 0.0 and later.lengths == ()
    unbounded = log.arrived(GenerateRequest.from_wire({"token_ids": [1, 2]}), now=100.0 + 1000.0)
    assert unbounded.max_tokens > 0  # a request up to the context counts with a guess, never 0
    assert list(log.requests) == [unbounded]  # the ones past the kept time are gone


def test_a_stepped_rate_moves_the_targets_up_at_once_and_down_within_two_intervals(
    tiny_model: str, tmp_path: Path
):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    settings = PlannerSettings(
        interval_s=INTERVAL_S, slos=(SLO(ttft=0.1, gap=0.04),), target=0.9, profile=str(profile)
    )
    planner = fleet_planner(load_model(tiny_model), BOUNDS, 1.0, settings, "push")
    log = TrafficLog()
    steps = [(2.0, "low"), (75.0, "high"), (2.0, "low"), (2.0, "low")]
    decisions = [planner.decide(traffic_at(rate, i * INTERVAL_S, log)) for i, (rate, _) in enumerate(steps)]
    low, high, first_low, second_low = decisions
    replicas = [sum(d.targets.values()) for d in decisions]
    assert low.meets and low.targets == {"prefill": 0, "decode": 1}  # the fewest that meet it
    assert high.rate == pytest.approx(75.0) and replicas[1] > replicas[0]  # up at once
    assert high.picked == high.targets and high.goodput is not None
    assert first_low.picked == low.targets and first_low.targets == high.targets  # one lull: held
    assert second_low.targets == low.targets  # two in a row: down
    assert all(d.prompt_tokens == pytest.approx(200.0) for d in decisions)
    record = json.loads(high.to_json())
    assert record["targets"] == high.targets and record["attainment"] == high.attainment

    idle = planner.decide(log.window(INTERVAL_S, now=100 * INTERVAL_S))
    assert idle.requests == 0 and idle.picked == {"prefill": 0, "decode": 1}

    # an overload no count serves (each prefill-bound): the most replicas, never the fewest
    overload = planner.decide(traffic_at(1000.0, 200 * INTERVAL_S, log))
    assert not overload.meets and overload.picked == {"prefill": 1, "decode": 2}
