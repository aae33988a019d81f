"""`sim retime`: a profile's step times re-timed from a live engine's step log (each step's
shape and the engine thread's CPU for it), through `serve --step-log` and the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from splitserve.cli import main
from splitserve.protocol.step_record import StepRecord, read_step_log
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.profile import EngineProfile, load_profile, save_profile
from splitserve.sim.retime import priced_steps, retime_profile, retime_steps
from splitserve.sim.step_model import StepModel
from tests.conftest import free_port, running_server

MODEL = StepModel(0.002, 20e-6, 4e-9, (1, 4, 16), (0.004, 0.006, 0.012), 1e-7, 0.001)


class Clock:
    """Step records of one engine thread whose CPU grows by each step's cost."""

    def __init__(self, threads: int = 1, pid: int = 7) -> None:
        self.cpu, self.t, self.threads, self.pid = 0.0, 0.0, threads, pid
        self.records = [self.record(0, 0, 0, ())]  # the process's first record carries no cost

    def record(self, cost_s: float, decodes: int, context: int, chunks: tuple, borrowed: bool = False):
        self.cpu += cost_s
        self.t += cost_s + 0.001
        tokens = decodes + sum(n for n, _ in chunks)
        return StepRecord(
            self.pid, "both", self.t, cost_s, tokens, decodes, self.cpu, 0.0,
            decodes, context, chunks, self.threads, borrowed,
        )  # fmt: skip

    def step(self, cost_s: float, decodes: int = 0, context: int = 0, chunks: tuple = (), **kw) -> None:
        self.records.append(self.record(cost_s, decodes, context, chunks, **kw))


def test_each_part_of_the_model_is_retimed_by_what_its_steps_cost():
    clock = Clock()
    for i in range(12):  # one sequence at 300 tokens of context: 1.5x the model
        clock.step(1.5 * float(MODEL.decode_s(1, 300 + i)), decodes=1, context=300 + i)
    for i in range(12):  # four and eight: 1.2x
        batch = 4 if i % 2 else 8
        clock.step(1.2 * float(MODEL.decode_s(batch, batch * 300)), decodes=batch, context=batch * 300)
    alone = MODEL.prefill_s(256)
    for _ in range(5):  # prompts alone and beside four decodes: the prompt's part 1.3x
        clock.step(1.3 * alone, chunks=((256, 0),))
        chunk = MODEL.mixed_fixed_s + MODEL.prefill_s_per_token * 64 + MODEL.prefill_s_per_pair * 64 * 160.5
        beside = 1.2 * float(MODEL.decode_s(4, 1200)) + 1.3 * chunk
        clock.step(beside, decodes=4, context=1200, chunks=((64, 128),))
    clock.step(50.0, decodes=1, context=300, borrowed=True)  # on a lender's CPUs too: not its own
    retimed, factors = retime_steps(MODEL, priced_steps(clock.records), threads=1)
    # 16 had no steps: the median over every decode step (half at 1.5, half at 1.2)
    assert factors.decode == pytest.approx((1.5, 1.2, 1.35))
    assert factors.prompt == pytest.approx(1.3, rel=0.01)
    assert (factors.decode_steps, factors.prompt_steps) == (24, 10)
    assert float(retimed.decode_s(1, 300)) == pytest.approx(1.5 * float(MODEL.decode_s(1, 300)))
    # the whole batch's time, its context term too: not the base alone
    assert float(retimed.decode_s(4, 1200)) == pytest.approx(1.2 * float(MODEL.decode_s(4, 1200)))
    assert float(retimed.decode_s(4, 40_000)) == pytest.approx(1.2 * float(MODEL.decode_s(4, 40_000)))
    assert retimed.decode_base_s == MODEL.decode_base_s
    assert retimed.prefill_s(256) == pytest.approx(1.3 * MODEL.prefill_s(256), rel=0.01)
    assert retimed.mixed_fixed_s == pytest.approx(1.3 * MODEL.mixed_fixed_s, rel=0.01)


def test_the_retimed_decode_table_stays_non_decreasing():
    clock = Clock()
    for _ in range(12):
        clock.step(2.0 * float(MODEL.decode_s(1, 100)), decodes=1, context=100)  # 8.0 ms: above B=4's 6
        clock.step(float(MODEL.decode_s(4, 400)), decodes=4, context=400)
    retimed, _ = retime_steps(MODEL, priced_steps(clock.records), threads=1)
    at_no_context = [float(retimed.decode_s(b, 0)) for b in MODEL.decode_batches]
    assert at_no_context == sorted(at_no_context)
    assert at_no_context[1] == pytest.approx(at_no_context[0])


def test_a_retimed_model_retimed_again_keeps_both_factors_and_survives_its_json():
    clock = Clock()
    for i in range(12):
        clock.step(0.8 * float(MODEL.decode_s(4, 1200 + i)), decodes=4, context=1200 + i)
    once, _ = retime_steps(MODEL, priced_steps(clock.records), threads=1)
    again, factors = retime_steps(once, priced_steps(clock.records), threads=1)
    assert factors.decode[1] == pytest.approx(1.0)  # the logged steps are what `once` says
    assert float(again.decode_s(4, 1200)) == pytest.approx(0.8 * float(MODEL.decode_s(4, 1200)))
    assert StepModel.from_json(again.to_json(), "test") == again
    assert "scale" not in MODEL.to_json()["decode"]
    bad = again.to_json()
    bad["decode"]["scale"] = [1.0, -1.0, 1.0]
    with pytest.raises(CalibrationError, match="one factor > 0 per batch size"):
        StepModel.from_json(bad, "test")


def test_a_profile_is_retimed_per_thread_count_and_refuses_a_log_it_cannot_use():
    other = StepModel(0.004, 40e-6, 8e-9, (1, 4), (0.008, 0.012), 2e-7)
    profile = EngineProfile(MODEL, threads=2, other_steps={1: other})
    one, two = Clock(threads=1, pid=1), Clock(threads=2, pid=2)
    for _ in range(12):
        one.step(2.0 * float(other.decode_s(1, 200)), decodes=1, context=200)
        two.step(0.5 * float(MODEL.decode_s(1, 200)), decodes=1, context=200)
    retimed, factors = retime_profile(profile, one.records + two.records)
    assert {f.threads: f.decode[0] for f in factors} == pytest.approx({1: 2.0, 2: 0.5})
    assert float(retimed.steps.decode_s(1, 200)) == pytest.approx(0.5 * float(MODEL.decode_s(1, 200)))
    slower = retimed.other_steps[1]
    assert float(slower.decode_s(1, 200)) == pytest.approx(2.0 * float(other.decode_s(1, 200)))
    assert retimed.threads == 2 and retimed.measured_steps().keys() == {1, 2}
    four = Clock(threads=4)
    four.step(0.01, decodes=1, context=10)
    refused = r"ran on \[4\] thread\(s\); the profile has steps of \[1, 2\]"
    with pytest.raises(CalibrationError, match=refused):
        retime_profile(profile, four.records)
    older = [r._replace(decodes=None, context=None, chunks=(), threads=None) for r in one.records]
    with pytest.raises(CalibrationError, match="no step with its shape"):
        retime_profile(profile, older)


def test_a_live_engines_step_log_retimes_a_profile_through_the_cli(tiny_model, tmp_path: Path, capsys):
    """`serve --step-log` records each step's shape; `sim retime` prices those steps with
    the profile's model and writes the profile re-timed by them."""
    log = tmp_path / "steps.jsonl"
    port = free_port()
    prompt = list(range(20, 60))
    with running_server(["serve", tiny_model, "--port", str(port), "--step-log", str(log)], port) as base:
        for first_token in (20, 100):  # two prompts: neither a prefix-cache hit
            body = {"prompt": [first_token + i for i in range(40)], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
    records = read_step_log(log)
    first = records[0]
    assert (first.decodes, first.context, first.chunks) == (0, 0, ((len(prompt), 0),))
    # then one token a step, each attending the prompt and the answer so far
    assert [(r.decodes, r.context) for r in records[1:12]] == [(1, len(prompt) + i) for i in range(11)]
    threads = first.threads
    assert threads is not None and threads >= 1 and not any(r.borrowed for r in records)
    profile = tmp_path / "profile.json"
    save_profile(EngineProfile(MODEL, threads=threads), str(profile))
    out = tmp_path / "retimed.json"
    args = ["sim", "retime", "--profile", str(profile), "--step-log", str(log), "--out", str(out), "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    (factors,) = report["factors"]
    assert factors["threads"] == threads and factors["decode_steps"] == 22 and factors["prompt_steps"] == 1
    # the tiny model's steps cost what they cost: the re-timed model prices the logged
    # one-token steps at their median CPU time
    cpu = [b.thread_cpu_s - a.thread_cpu_s for a, b in itertools.pairwise(records) if b.decodes == 1]
    retimed = load_profile(str(out)).steps
    assert float(retimed.decode_s(1, 0)) / float(MODEL.decode_s(1, 0)) == pytest.approx(factors["decode"][0])
    assert float(retimed.decode_s(1, 45)) == pytest.approx(float(np.median(cpu)), rel=0.02)
    assert report["waits"] is None and load_profile(str(out)).waits is None
    # --waits: what the steps waited for a core beyond their CPU, fitted (one engine: always
    # with no other engine stepping) with the spread of their wall times around the model
    assert main([*args, "--waits"]) == 0
    report = json.loads(capsys.readouterr().out)
    idle, stepping = load_profile(str(out)).waits.kinds["decode"]
    assert report["waits"]["decode"]["others_idle"]["steps"] == idle.steps == len(records) - 1
    assert stepping == idle and min(idle[:3]) >= 0.0
    spread = load_profile(str(out)).waits.spread("decode")
    # as logged over predicted (tests/sim/test_step_waits.py): the middle step near its model
    assert len(spread) == 41 and list(spread) == sorted(spread) and 0.5 < spread[20] < 2.0
    # what the log cannot give is refused, and nothing is written
    assert main(["sim", "retime", "--profile", str(profile), "--step-log", str(tmp_path / "no.jsonl"),
                 "--out", str(tmp_path / "x.json")]) == 2  # fmt: skip
    assert "cannot read it" in capsys.readouterr().err
    before = str(first.t)  # only the steps logged before the first one ended: none
    assert main(["sim", "retime", "--profile", str(profile), "--step-log", str(log), "--before", before,
                 "--out", str(tmp_path / "x.json")]) == 2  # fmt: skip
    assert f"no steps logged before {before}" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
