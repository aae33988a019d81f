"""Conditional disaggregation on cost: the pure decision (protocol/pd_decision.py), the
proxy's measurements (router/pd_costs.py), the profile file and flags, and the paths
requests take through a live `splitserve up --pd-decision cost`."""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.cli import main
from splitserve.protocol.pd_decision import (
    CostModel,
    CostProfileError,
    DecisionInputs,
    break_even_tokens,
    decide,
    load_cost_profile,
    parse_cost_profile,
    threshold_decision,
)
from splitserve.router.pd_costs import MIN_STEP_TOKENS, CostCalibrator
from splitserve.router.pd_policy import PDPolicy
from splitserve.sim.calibrate import samples_to_json, synthetic_samples
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.specs import load_gpu, load_model
from tests.conftest import free_port, running_servers, wait_until
from tests.router.test_pd_proxy import metric

# The numbers measured on this machine for the tiny model (docs/pd.md), pinned so the
# paths below do not depend on how busy the shared machine is.
COSTS = CostModel(
    handoff_fixed_s=0.02,
    prefill_s_per_token=30e-6,
    decode_prefill_s_per_token=30e-6,
    stall_fraction=1.0,
    min_charged_streams=1.0,
)


def idle(tokens: int) -> DecisionInputs:
    return DecisionInputs(tokens, 0, 0, 0)


# The compiled CPU kernels are built on a process's first step (a minute or more on a
# busy machine); the paths and tokens compared here do not depend on them.
REFERENCE_KERNELS = {"SPLITSERVE_NATIVE_OPS": "0"}
PROXY = ["proxy", "--render", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


# ---- the pure function --------------------------------------------------------------


def test_idle_short_prompts_stay_local_long_ones_go_remote():
    assert not decide(idle(32), COSTS).remote
    assert decide(idle(1500), COSTS).remote
    decision = decide(idle(32), COSTS)
    assert decision.local_cost_s < decision.remote_cost_s and decision.reason == "local is cheaper"
    assert not decide(idle(0), COSTS).remote  # decode holds the whole prompt


def test_a_busy_decode_moves_the_break_even_down():
    idle_even = break_even_tokens(COSTS)
    busy_even = break_even_tokens(COSTS, decode_streams=8)
    assert 32 < idle_even < 1500
    assert busy_even < idle_even / 4
    between = int((idle_even + busy_even) / 2)
    assert not decide(idle(between), COSTS).remote
    assert decide(DecisionInputs(between, 8, 0, 0), COSTS).remote


def test_break_even_is_where_the_decision_flips():
    for streams, decode_queue, prefill_queue in [(0, 0, 0), (3, 0, 0), (1, 500, 0), (2, 0, 900)]:
        even = break_even_tokens(COSTS, streams, decode_queue, prefill_queue)
        assert math.isfinite(even)
        below, above = max(1, math.floor(even) - 1), math.ceil(even) + 1
        assert not decide(DecisionInputs(below, streams, decode_queue, prefill_queue), COSTS).remote
        assert decide(DecisionInputs(above, streams, decode_queue, prefill_queue), COSTS).remote


def test_the_decision_is_monotonic_in_each_input():
    lengths, streams = [1, 16, 64, 200, 400, 700, 1000, 1500, 3000], [0, 1, 2, 4, 8, 32]
    for n in lengths:  # more running streams never move a prompt back to decode
        path = [decide(DecisionInputs(n, s, 0, 0), COSTS).remote for s in streams]
        assert path == sorted(path), (n, path)
    for s in streams:  # a longer prompt never moves back to decode
        path = [decide(DecisionInputs(n, s, 0, 0), COSTS).remote for n in lengths]
        assert path == sorted(path), (s, path)
    queues = [0, 100, 1000, 10_000]
    for n in lengths:  # a longer prefill queue never moves a prompt to prefill; decode's does
        by_prefill = [decide(DecisionInputs(n, 1, 0, q), COSTS).remote for q in queues]
        by_decode = [decide(DecisionInputs(n, 1, q, 0), COSTS).remote for q in queues]
        assert by_prefill == sorted(by_prefill, reverse=True) and by_decode == sorted(by_decode)


def test_without_interference_equal_costs_never_pay_for_a_handoff():
    """The source document's point: with nothing to protect, P/D only adds the handoff."""
    pure_ttft = CostModel(handoff_fixed_s=0.02, prefill_s_per_token=30e-6, decode_prefill_s_per_token=30e-6,
                          min_charged_streams=0)  # fmt: skip
    assert break_even_tokens(pure_ttft) == math.inf
    assert not decide(idle(100_000), pure_ttft).remote
    assert decide(DecisionInputs(1500, 1, 0, 0), pure_ttft).remote  # one stream to protect
    faster_prefill = CostModel(
        prefill_s_per_token=10e-6, decode_prefill_s_per_token=30e-6, min_charged_streams=0
    )
    assert break_even_tokens(faster_prefill) == pytest.approx(0.02 / 20e-6)


def test_threshold_keeps_the_fixed_rule():
    policy = PDPolicy(min_prefill_tokens=64, decision="threshold")
    for n, streams in [(63, 0), (64, 0), (63, 100), (5000, 0)]:
        decision = threshold_decision(DecisionInputs(n, streams, 0, 0), policy.min_prefill_tokens, COSTS)
        assert decision.remote == policy.use_prefill_pool(n)
    with pytest.raises(ValueError, match="P/D decision"):
        PDPolicy(decision="coin")  # type: ignore[arg-type]
    assert PDPolicy().decision == "cost"


# ---- the profile ----------------------------------------------------------------------


def test_a_profile_pins_the_fields_it_names():
    profile = parse_cost_profile({"handoff_fixed_s": 0.05, "min_charged_streams": 0})
    assert profile.pinned == {"handoff_fixed_s", "min_charged_streams"}
    assert (
        profile.costs.handoff_fixed_s == 0.05
        and profile.costs.prefill_s_per_token == CostModel().prefill_s_per_token
    )


def test_a_sim_calibrate_file_is_a_profile(tmp_path: Path):
    """`splitserve sim calibrate --engine URL --save FILE` writes prefill step times; their
    slope is the cost per prompt token on both sides."""
    model, gpu = load_model("Qwen2.5-7B"), load_gpu("L40S")
    rl = Roofline(model, gpu, Efficiency())
    samples = synthetic_samples(rl, Efficiency(0.5, 0.7, 0.002), noise=0.0)
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps({"model": model.name, "gpu": gpu.name, "samples": samples_to_json(samples)}))
    profile = load_cost_profile(str(path))
    prefill = [(s.tokens, s.step_s) for s in samples if s.kind == "prefill" and s.context == 0]
    (n0, t0), (n1, t1) = prefill[0], prefill[-1]
    assert profile.costs.prefill_s_per_token == pytest.approx((t1 - t0) / (n1 - n0), rel=0.3)
    assert profile.costs.decode_prefill_s_per_token == profile.costs.prefill_s_per_token
    assert profile.pinned == {"prefill_s_per_token", "decode_prefill_s_per_token"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{nope", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"handoff_s": 0.1}', "unknown field 'handoff_s'"),
        ('{"handoff_fixed_s": -1}', "handoff_fixed_s must be >= 0"),
        ('{"prefill_s_per_token": "fast"}', "prefill_s_per_token must be a finite number"),
        ('{"prefill_s_per_token": 0}', "must be > 0"),
        ('{"samples": [{"kind": "prefill", "num_tokens": 64, "step_time_s": 0.01}]}', "two prompt lengths"),
    ],
)
def test_a_bad_profile_stops_the_proxy_with_a_clear_error(
    tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(CostProfileError, match=message):
        load_cost_profile(str(path))
    assert main([*PROXY, "--pd-cost-profile", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert "--pd-cost-profile" in stderr and message in stderr


def test_a_missing_profile_and_an_unknown_rule_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    assert main([*PROXY, "--pd-cost-profile", str(tmp_path / "absent.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main([*PROXY, "--pd-decision", "guess"])
    assert refused.value.code == 2 and "invalid choice" in capsys.readouterr().err


# ---- what the proxy measures ------------------------------------------------------------


def stats(step_s: float, tokens: int) -> dict:
    return {"last_step_time_s": step_s, "last_step_tokens": tokens, "num_waiting_prefill_tokens": 0}


def test_the_prefill_cost_per_token_comes_from_the_prefill_workers_steps():
    calibrator = CostCalibrator()
    assert calibrator.costs() == CostModel()  # defaults until something is measured
    calibrator.observe_stats("http://d", "decode", stats(0.04, 1000))  # decode's steps mix decodes in
    calibrator.observe_stats("http://p", "prefill", stats(0.001, MIN_STEP_TOKENS - 1))  # a step's fixed cost
    assert calibrator.measured() == {}
    calibrator.observe_stats("http://p", "prefill", stats(0.03, 1000))
    assert calibrator.costs().prefill_s_per_token == pytest.approx(30e-6)
    assert calibrator.costs().decode_prefill_s_per_token == pytest.approx(30e-6)
    for _ in range(5):  # an idle engine reports its last step again: one observation
        calibrator.observe_stats("http://p", "prefill", stats(0.06, 1000))
    assert calibrator.costs().prefill_s_per_token == pytest.approx(30e-6 + 0.2 * 30e-6)


def test_the_handoff_is_what_the_remote_path_spends_beyond_the_local_one():
    calibrator = CostCalibrator(
        parse_cost_profile({"prefill_s_per_token": 30e-6, "decode_prefill_s_per_token": 30e-6})
    )
    # remote: 1000 tokens of prefill (30 ms) + 25 ms; local: 100 tokens (3 ms) + 5 ms
    calibrator.observe_first_token(idle(1000), remote=True, ttft_s=0.055)
    assert calibrator.costs().handoff_fixed_s == pytest.approx(0.025)  # no local figure yet: all of it
    calibrator.observe_first_token(idle(100), remote=False, ttft_s=0.008)
    assert calibrator.costs().handoff_fixed_s == pytest.approx(0.020)
    snapshot = calibrator.snapshot()
    assert snapshot["source"]["handoff_fixed_s"] == "measured"
    assert snapshot["source"]["prefill_s_per_token"] == "profile"
    assert snapshot["break_even_tokens_idle"] == math.ceil(0.02 / 30e-6)
    # one slow first token (a fresh stack's first KV transfer) does not move the median
    calibrator.observe_first_token(idle(1000), remote=True, ttft_s=0.155)
    for _ in range(2):
        calibrator.observe_first_token(idle(1000), remote=True, ttft_s=0.055)
    assert calibrator.costs().handoff_fixed_s == pytest.approx(0.020)
    pinned = CostCalibrator(parse_cost_profile({"handoff_fixed_s": 0.5}))
    pinned.observe_first_token(idle(1000), remote=True, ttft_s=0.055)
    assert pinned.costs().handoff_fixed_s == 0.5 and pinned.measured()["handoff_fixed_s"] > 0


# ---- through a live stack --------------------------------------------------------------


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def completion(base: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def paths(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {
        p: metric(text, "splitserve_proxy_requests_total", f'{{path="{p}"}}')
        for p in ("decode_only", "pd_push")
    }


def queues_seen_empty(base: str) -> bool:
    """Whether the proxy's latest load reports show no prompt tokens queued anywhere (a
    report polled while the previous request ran stays until the next poll)."""
    return all(
        view["queued_prefill_tokens"] == 0 for view in httpx.get(f"{base}/workers").json()["load"].values()
    )


def path_of(base: str, prompt: list[int]) -> tuple[str, list[int]]:
    assert wait_until(lambda: queues_seen_empty(base), 30), httpx.get(f"{base}/workers").json()["load"]
    before = paths(base)
    tokens = completion(base, prompt)
    after = paths(base)
    taken = [p for p in after if after[p] != before[p]]
    assert len(taken) == 1, (before, after)
    return taken[0], tokens


@contextlib.contextmanager
def streaming(base: str, count: int) -> Iterator[None]:
    """`count` long streams decoding on the stack, each past its first token (the proxy
    counts a stream from the chunk it sends on), closed on exit."""
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        readers: list[Iterator[str]] = []
        for i in range(count):
            body = {"prompt": random_prompt(100 + i, 20), "max_tokens": 3000, "ignore_eos": True,
                    "temperature": 0, "stream": True, "return_token_ids": True}  # fmt: skip
            response = stack.enter_context(client.stream("POST", f"{base}/v1/completions", json=body))
            assert response.status_code == 200
            lines = response.iter_lines()
            readers.append(lines)  # a dropped line iterator closes its response
            while not any(c.get("token_ids") or c.get("text") for c in first_choices(next(lines))):
                pass
        yield


def first_choices(line: str) -> list[dict]:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return []
    return json.loads(line.removeprefix("data: ")).get("choices") or []


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """The collocated `serve` (the reference) and the `up` under test, started side by side."""
    profile = tmp_path_factory.mktemp("pd-cost") / "profile.json"
    pinned = {k: v for k, v in COSTS.__dict__.items() if k != "handoff_s_per_token"}
    profile.write_text(json.dumps(pinned))
    serve_port, up_port = free_port(), free_port()
    serve_args = ["serve", tiny_model, "--port", str(serve_port), "--num-blocks", "1024"]
    up_args = ["up", tiny_model, "--port", str(up_port), "--num-blocks", "1024", "--pd-decision", "cost",
               "--pd-cost-profile", str(profile)]  # fmt: skip
    with running_servers(
        [(serve_args, serve_port), (up_args, up_port)], timeout=180, env=REFERENCE_KERNELS
    ) as (collocated, stack):
        yield collocated, stack


def test_up_decides_each_path_on_cost(servers: tuple[str, str]):
    """Idle: a 32-token prompt stays on decode and a 1,500-token one goes through prefill,
    both with `serve`'s greedy tokens. With decode streaming, a 400-token prompt that
    stays on decode idle goes through prefill (break-even 667 idle, 167 with 4 streams)."""
    collocated, stack = servers
    prompts = {name: random_prompt(seed, n) for seed, (name, n) in enumerate(
        [("short", 32), ("long", 1500), ("middle_idle", 400), ("middle_busy", 400)])}  # fmt: skip
    expected = {name: completion(collocated, prompt) for name, prompt in prompts.items()}
    assert path_of(stack, prompts["short"]) == ("decode_only", expected["short"])
    assert path_of(stack, prompts["long"]) == ("pd_push", expected["long"])
    assert path_of(stack, prompts["middle_idle"]) == ("decode_only", expected["middle_idle"])
    with streaming(stack, 4):
        assert path_of(stack, prompts["middle_busy"]) == ("pd_push", expected["middle_busy"])
    # the proxy measured what the profile left open, and shows what it decides with
    deadline = time.monotonic() + 30
    while (
        "prefill_s_per_token" not in (costs := httpx.get(f"{stack}/workers").json()["pd_costs"])["measured"]
    ):
        assert time.monotonic() < deadline, costs
        time.sleep(0.1)
    assert costs["source"]["handoff_fixed_s"] == "profile" and costs["break_even_tokens_idle"] == 667
    assert costs["local_fixed_s"] is not None and costs["remote_fixed_s"] is not None
    assert httpx.get(f"{stack}/workers").json()["policy"]["decision"] == "cost"
