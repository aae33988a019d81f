"""`splitserve up --plan --rate R`: the layout the planner ranks first for this host is the
one printed as picked and the one started; the pick follows the rate where the simulator
says it should; `--plan` refuses the layout flags it chooses itself."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from splitserve.cli import main
from splitserve.config import UP_LONG_PREFILL_TOKEN_THRESHOLD, SchedulerConfig
from splitserve.goodput import SLO
from splitserve.sim.host_planner import host_deployment, host_layouts, rank_layouts
from splitserve.sim.profile import load_profile
from splitserve.sim.specs import load_model
from splitserve.sim.workload import synthetic
from tests.conftest import free_port, wait_until
from tests.model.gguf_files import GGUF_SPEC, write_tiny_gguf

# A tiny engine profile (the shape `sim calibrate --out` writes): 2 ms + 20 us per prompt
# token per prefill step; decode steps of 4 ms at batch 1 up to 12 ms at batch 16.
STEPS = {
    "prefill": {"fixed_s": 0.002, "s_per_token": 20e-6, "s_per_pair": 4e-9},
    "decode": {"batch_sizes": [1, 4, 16], "base_s": [0.004, 0.006, 0.012], "s_per_context_token": 1e-7},
}
PROFILE = {"model": "tiny", "gpu": "cpu", "handoff_fixed_s": 0.002, "sim": {"version": 1, "steps": STEPS}}
LENGTHS = ("200", "16")
SLO_FLAGS = ["--slo-ttft", "100ms", "--slo-gap", "40ms"]
MAX_ENGINES = 2
LOW_RATE, HIGH_RATE = 2.0, 75.0


def write_profile(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def planner_pick(model: str, profile: str, rate: float) -> str:
    """The planner function's own first choice for these inputs (the label `up` prints)."""
    from splitserve.deploy.up_plan import PLAN_STEADY_STATE

    cpus = sorted(os.sched_getaffinity(0))
    scheduler = SchedulerConfig(long_prefill_token_threshold=UP_LONG_PREFILL_TOKEN_THRESHOLD)  # as `up`
    base = host_deployment(load_model(model), load_profile(profile), scheduler)

    def make(r: float, n: int, seed: int):
        return synthetic(r, n, LENGTHS[0], LENGTHS[1], seed=seed)

    slo = SLO(ttft=0.1, gap=0.04)
    layouts = host_layouts(cpus, MAX_ENGINES)
    ranked = rank_layouts(layouts, base, make, [slo], rate, 200.0, len(cpus), 0.9, PLAN_STEADY_STATE, 4)
    assert ranked[0].meets, ranked
    return ranked[0].layout.label()


def dry_run(model: str, profile: str, rate: float, capsys) -> str:
    code = main(
        ["up", model, "--plan", "--rate", str(rate), "--profile", profile, "--lengths", "/".join(LENGTHS),
         *SLO_FLAGS, "--plan-max-engines", str(MAX_ENGINES), "--dry-run"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "candidate layouts" in out and f"engine profile {profile}" in out
    (picked,) = re.findall(r"^picked: (.+?) \(--prefill", out, re.M)
    return picked


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: one layout to choose from")
def test_dry_run_picks_the_planners_first_choice_and_the_pick_follows_the_rate(
    tiny_model: str, tmp_path: Path, capsys
):
    profile = write_profile(tmp_path)
    picks = {rate: dry_run(tiny_model, profile, rate, capsys) for rate in (LOW_RATE, HIGH_RATE)}
    expected = {rate: planner_pick(tiny_model, profile, rate) for rate in (LOW_RATE, HIGH_RATE)}
    assert picks == expected
    # the simulator's view: one engine serves the low rate, not the high one
    assert expected[LOW_RATE] != expected[HIGH_RATE]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--plan", "--rate", "1", "--decode", "2"], "--plan chooses the layout itself: drop --decode"),
        (["--plan", "--rate", "1", "--prefill", "0", "--cpu-affinity", "decode=0"],
         "drop --prefill, --cpu-affinity"),
        (["--plan"], "--plan needs --rate"),
        (["--rate", "1", "--dry-run"], "--rate, --dry-run: only with --plan"),
        (["--plan", "--rate", "1", "--ray"], "not with --ray"),
    ],
)  # fmt: skip
def test_plan_refuses_the_flags_it_would_choose(flags: list[str], message: str, capsys):
    assert main(["up", "/no/such/model", *flags]) == 2  # refused before the model is looked for
    assert message in capsys.readouterr().err


def test_a_bad_profile_or_lengths_spec_is_a_clear_error(tiny_model: str, tmp_path: Path, capsys):
    for extra, message in [
        (["--profile", str(tmp_path / "absent.json")], "no such file"),
        (["--lengths", "256"], "not PROMPT/OUTPUT"),
    ]:
        assert main(["up", tiny_model, "--plan", "--rate", "1", "--dry-run", *extra]) == 2
        assert message in capsys.readouterr().err


def test_a_gguf_model_is_planned_from_its_metadata(tmp_path: Path, capsys):
    gguf = write_tiny_gguf(tmp_path / "llama.gguf", GGUF_SPEC["llama"], "Q8_0")
    flags = ["--plan", "--rate", "1", "--lengths", "32/8", "--plan-max-engines", "1", "--dry-run"]
    assert main(["up", str(gguf), *flags]) == 0
    out = capsys.readouterr().out
    assert "no --profile: the simulator's roofline" in out
    assert "picked: 1 decode (serve-like) (--prefill 0 --decode 1)" in out


def test_up_plan_starts_its_pick_which_answers_and_stops_cleanly(tiny_model: str, tmp_path: Path):
    port = free_port()
    log = tmp_path / "up.log"
    command = [sys.executable, "-m", "splitserve.cli", "up", tiny_model, "--port", str(port), "--plan",
               "--rate", "1", "--profile", write_profile(tmp_path), "--lengths", "32/8",
               "--plan-max-engines", "1", "--num-blocks", "256"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: "OpenAI API:" in log.read_text() or proc.poll() is not None, 240)
        text = log.read_text()
        assert "picked: 1 decode (serve-like) (--prefill 0 --decode 1)" in text, text
        assert re.search(r"^\s+decode-0\s+http://", text, re.M) and "prefill-0" not in text
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "splitserve up: stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
