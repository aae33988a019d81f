"""The engine profile: `sim calibrate --engine URL --out FILE` against a live engine on a
tiny model, the file read by `--profile` (simulator, planner) and by the proxy's
`--pd-cost-profile`, and distribution-aware planning (`sim plan --lengths FILE`)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from splitserve.cli import main
from splitserve.protocol.pd_decision import load_cost_profile
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from splitserve.sim.profile import load_profile
from tests.conftest import free_port, running_servers
from tests.sim.test_sim_cli import run_sim

ROOT = Path(__file__).resolve().parents[2]
HOST = {"name": "cpu-host", "peak_flops": 1e11, "mem_bw": 1e10, "mem_bytes": 8e9}
REFERENCE_KERNELS = {"SPLITSERVE_NATIVE_OPS": "0"}  # no kernel build on the first step


def write(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def finished(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out)


# ---- calibrating against a live engine ---------------------------------------------------


def step_counters(base: str) -> tuple[float, float]:
    found = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("splitserve_step_time_seconds_sum", "splitserve_step_time_seconds_count"):
            found[name] = float(value)
    return found["splitserve_step_time_seconds_sum"], found["splitserve_step_time_seconds_count"]


def generate(base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(base + "/inference/v1/generate", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def held_out_prefill_s(base: str, tokens: int) -> float:
    """The fastest of 3 single-step prefills of fresh prompts, from the engine's histogram."""
    times = []
    for i in range(3):
        before = step_counters(base)
        generate(base, [(7 * i + j) % 200 + 10 for j in range(tokens)], 1)
        after = step_counters(base)
        if after[1] - before[1] == 1:
            times.append(after[0] - before[0])
    assert times, "no held-out prefill ran in one step"
    return min(times)


def held_out_decode_s(base: str, batch: int, context: int, max_tokens: int = 24) -> float:
    """The fastest of 3 runs of `batch` requests decoding together: the median request's
    engine-side mean inter-token latency."""
    best = float("inf")
    for run in range(3):
        itls: list[float] = []

        def one(k: int, run: int = run, itls: list[float] = itls) -> None:
            prompt = [(11 * k + 3 * run + j) % 200 + 10 for j in range(context)]
            itls.append(generate(base, prompt, max_tokens)["metrics"]["mean_itl_ms"] / 1e3)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, sorted(itls)[len(itls) // 2])
    return best


def test_calibrate_a_live_engine_predicts_held_out_steps(tiny_model: str, tmp_path: Path):
    host = write(tmp_path / "host.json", HOST)
    out = tmp_path / "profile.json"
    engine_port, render_port = free_port(), free_port()
    engine_args = [
        "engine",
        tiny_model,
        "--port",
        str(engine_port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    render_args = ["render", tiny_model, "--port", str(render_port)]
    servers = [(engine_args, engine_port), (render_args, render_port)]
    with running_servers(servers, env=REFERENCE_KERNELS) as (engine, render):
        code = main(
            ["sim", "calibrate", "--engine", engine, "--render", render, "--model", tiny_model,
             "--gpu", host, "--out", str(out), "--probe-prefill", "32,512,1024",
             "--probe-batches", "1,4,8", "--probe-contexts", "64,512", "--repeats", "3"]
        )  # fmt: skip
        assert code == 0
        prefill_measured = held_out_prefill_s(engine, 320)
        decode_measured = held_out_decode_s(engine, 3, 200)
    profile = load_profile(str(out))
    steps = profile.steps
    # A shared, noisy machine (neighbours slow any sample several times over, the fastest
    # of 3 kept on both sides): the held-out shapes, not among those probed, are predicted
    # within an order of magnitude, and the fitted times grow with the work as measured.
    prefill_predicted = steps.prefill_s(320)
    decode_predicted = float(steps.decode_s(3, 3 * (200 + 12)))
    fitted = f"fitted {steps}"  # what a failure on a noisy machine needs to be read
    assert prefill_measured / 10 < prefill_predicted < prefill_measured * 10, (prefill_measured, fitted)
    assert decode_measured / 10 < decode_predicted < decode_measured * 10, (decode_measured, fitted)
    assert steps.prefill_s(1024) > steps.prefill_s(32) > 0, fitted
    # the engine API's time beyond its steps: a request's HTTP way in and out, never nothing
    assert profile.cpu is not None and 0 < profile.cpu.api_s_per_request < 1.0, profile.cpu
    # prompts prefilled beside decodes (12 tries, each kept only if its steps were the
    # shapes asked for): what a chunk adds to a decode step, >= 0 by construction
    assert any(s.kind == "mixed" and s.batch in (1, 4) for s in profile.samples), profile.samples
    assert steps.mixed_fixed_s >= 0, fitted
    assert list(steps.decode_base_s) == sorted(steps.decode_base_s), fitted
    # what rendering a request costs (the fit's intercept alone may be pinned at 0 by noise:
    # a fixed part too small against the per-token slope to show)
    assert profile.cpu is not None and profile.cpu.delay_s(320) > 0, profile.cpu
    # the same file is the proxy's --pd-cost-profile: it pins the measured prefill cost
    pd = load_cost_profile(str(out))
    assert pd.pinned == {"prefill_s_per_token", "decode_prefill_s_per_token"}
    assert pd.costs.prefill_s_per_token == pytest.approx(profile.decision_costs().prefill_s_per_token)
    assert 1e-8 < pd.costs.prefill_s_per_token < 1e-2


# ---- the profile in the simulator -------------------------------------------------------

STEPS = {
    "prefill": {"fixed_s": 0.002, "s_per_token": 20e-6, "s_per_pair": 4e-9},
    "decode": {"batch_sizes": [1, 4, 16], "base_s": [0.004, 0.006, 0.012], "s_per_context_token": 1e-7},
}


def profile_doc(
    steps: dict,
    render_ms: float = 0.0,
    path_ms_per_token: float = 0.0,
    path_ms_per_step: float = 0.0,
    **costs: float,
) -> dict:
    sim: dict = {"version": 1, "steps": steps}
    if render_ms or path_ms_per_token or path_ms_per_step:
        sim["cpu"] = {
            "render_s_per_request": render_ms / 1e3,
            "cpu_s_per_token": path_ms_per_token / 1e3,
            "cpu_s_per_step": path_ms_per_step / 1e3,
        }
    return {"model": "tiny", "gpu": "cpu-host", **costs, "sim": sim}


def simulate_json(profile: str, host: str, tiny_model: str, *extra: str) -> subprocess.Popen:
    return run_sim(
        ["simulate", "--model", tiny_model, "--gpu", host, "--profile", profile, "--replicas", "1",
         "--design", "collocated", "--rates", "0.2", "--requests", "40", "--seeds", "1", "--json", *extra]
    )  # fmt: skip


def test_a_profile_sets_the_simulated_step_times(tiny_model: str, tmp_path: Path):
    host = write(tmp_path / "host.json", HOST)
    slow = json.loads(json.dumps(STEPS))
    slow["decode"]["base_s"] = [2 * t for t in STEPS["decode"]["base_s"]]
    files = {
        "base": write(tmp_path / "base.json", profile_doc(STEPS)),
        "slow_decode": write(tmp_path / "slow.json", profile_doc(slow)),
        "render": write(tmp_path / "render.json", profile_doc(STEPS, render_ms=30)),
        "serving_path": write(tmp_path / "path.json", profile_doc(STEPS, path_ms_per_token=10)),
    }
    procs = {
        k: simulate_json(f, host, tiny_model, "--prompt", "200", "--output", "8") for k, f in files.items()
    }
    rows = {k: finished(p)["rows"][0] for k, p in procs.items()}
    # at 0.2 req/s requests run alone: TTFT is the prompt's one prefill step, every gap a
    # batch-1 decode step at the request's context (200 to 207 tokens)
    prefill_s = 0.002 + 20e-6 * 200 + 4e-9 * 200 * 100.5
    assert rows["base"]["ttft_median_s"] == pytest.approx(prefill_s, rel=0.02)
    assert rows["base"]["itl_p50_s"] == pytest.approx(0.004 + 1e-7 * 204, rel=0.02)
    assert rows["slow_decode"]["itl_p50_s"] == pytest.approx(0.008 + 1e-7 * 204, rel=0.02)
    assert rows["slow_decode"]["ttft_median_s"] == pytest.approx(prefill_s, rel=0.02)
    assert rows["render"]["ttft_median_s"] == pytest.approx(prefill_s + 0.030, rel=0.02)
    assert rows["render"]["itl_p50_s"] == pytest.approx(rows["base"]["itl_p50_s"], rel=1e-6)
    # a serving path of 10 ms per streamed token runs on the engine's cores: every step
    # that streams a token takes that much longer, the first token's too
    assert rows["serving_path"]["itl_p50_s"] == pytest.approx(0.014 + 1e-7 * 204, rel=0.02)
    assert rows["serving_path"]["ttft_median_s"] == pytest.approx(prefill_s + 0.010, rel=0.02)


def test_a_serving_path_slower_than_the_tokens_queues_them(tiny_model: str, tmp_path: Path):
    """5 req/s of 32-token answers are 160 tokens/s: the engine keeps up, a serving path of
    10 ms per token on its cores (at most 100 tokens/s) does not, and the streams queue."""
    host = write(tmp_path / "host.json", HOST)
    files = [write(tmp_path / "base.json", profile_doc(STEPS))]
    files.append(write(tmp_path / "path.json", profile_doc(STEPS, path_ms_per_token=10)))
    # the same 10 ms charged per step that streams instead: a batch pays it once, so the
    # engine keeps up with the streams sharing its steps
    files.append(write(tmp_path / "step.json", profile_doc(STEPS, path_ms_per_step=10)))
    procs = [
        simulate_json(f, host, tiny_model, "--prompt", "200", "--output", "32", "--rates", "5") for f in files
    ]
    alone, queued, per_step = (finished(p)["rows"][0] for p in procs)
    assert alone["ttft_p99_s"] < 0.1 and alone["itl_p50_s"] < 0.01
    assert queued["ttft_p99_s"] > 10 * alone["ttft_p99_s"]
    assert queued["tpot_median_s"] > 0.0105  # above the 10 ms alone: streams share the path
    assert per_step["ttft_p99_s"] < 0.2 and 0.014 < per_step["itl_p50_s"] < 0.03


def test_a_bad_profile_is_refused_with_a_clear_error(tiny_model: str, tmp_path: Path, capsys):
    host = write(tmp_path / "host.json", HOST)
    bad_steps = write(tmp_path / "bad.json", {"sim": {"steps": {"prefill": {}}}})
    negative = write(tmp_path / "neg.json", profile_doc(STEPS, handoff_fixed_s=-1.0))
    for path, message in [
        (bad_steps, "sim.steps needs prefill"),
        (negative, "handoff_fixed_s must be a number >= 0"),
        (str(tmp_path / "absent.json"), "no such file"),
    ]:
        assert main(["sim", "simulate", "--model", tiny_model, "--gpu", host, "--profile", path]) == 2
        assert message in capsys.readouterr().err


# ---- distribution-aware planning ----------------------------------------------------------


def bimodal(path: Path) -> str:
    """90% short chats (40-token prompts, 64 outputs), 10% long documents (3,000, 16)."""
    lines = [
        {"prompt_tokens": 3000, "output_tokens": 16}
        if i % 10 == 0
        else {"prompt_tokens": 40, "output_tokens": 64}
        for i in range(200)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def plan(profile: str, host: str, tiny_model: str, *workload: str) -> subprocess.Popen:
    return run_sim(
        ["plan", "--model", tiny_model, "--gpu", host, "--profile", profile, "--rate", "8", "--slo",
         "custom", "--ttft", "0.2", "--worst-gap-ms", "20", "--max-gpus", "2", "--budgets", "512",
         "--json", *workload]
    )  # fmt: skip


def test_a_bimodal_plan_differs_from_the_plan_of_its_means(tiny_model: str, tmp_path: Path):
    """At 8 req/s the means (336-token prompts, 59 outputs) fit one collocated engine. The
    real mix does not: a 3,000-token prompt's chunks stall every stream decoding beside it
    past 20 ms. The plan from the distribution goes P/D and knows that the long prompts
    (and, under load, a few short ones) take the prefill worker, most short ones staying
    on decode."""
    host = write(tmp_path / "host.json", HOST)
    profile = write(tmp_path / "profile.json", profile_doc(STEPS, handoff_fixed_s=0.02))
    lengths = bimodal(tmp_path / "observed.jsonl")
    means = plan(profile, host, tiny_model, "--prompt", "336", "--output", "59")
    mix = plan(profile, host, tiny_model, "--lengths", lengths)
    from_means, from_mix = finished(means)["plans"], finished(mix)["plans"]
    assert from_means[0]["gpus"] == 1 and from_means[0]["collocated"] == 1
    assert from_mix[0]["gpus"] == 2 and from_mix[0]["prefill"] == 1 and from_mix[0]["decode"] == 1
    assert 0.08 <= from_mix[0]["remote_fraction"] <= 0.3
    assert all(p["gpus"] > 1 for p in from_mix)


def test_lengths_come_from_counts_datasets_and_bench_results(tiny_model: str, tmp_path: Path):
    host = write(tmp_path / "host.json", HOST)
    profile = write(tmp_path / "profile.json", profile_doc(STEPS))
    counts = tmp_path / "counts.jsonl"
    counts.write_text(json.dumps({"input_length": 100, "output_length": 5}) + "\n")
    dataset = tmp_path / "dataset.jsonl"
    chat = {"messages": [{"role": "user", "content": " ".join(["word"] * 100)}], "max_tokens": 5}
    dataset.write_text(json.dumps(chat) + "\n")
    results = tmp_path / "bench.json"
    request = {"warmup": False, "error": None, "input_tokens": 100, "output_tokens": 5}
    results.write_text(json.dumps({"version": 1, "levels": [{"requests": [request]}]}))
    procs = [
        simulate_json(profile, host, tiny_model, "--lengths", str(path))
        for path in (counts, dataset, results)
    ]
    rows = [finished(p)["rows"][0] for p in procs]
    expected_ttft = 0.002 + 20e-6 * 100 + 4e-9 * 100 * 50.5
    for row in rows:
        assert row["ttft_median_s"] == pytest.approx(expected_ttft, rel=0.02)


def test_bad_lengths_are_refused(tiny_model: str, tmp_path: Path, capsys):
    host = write(tmp_path / "host.json", HOST)
    cases = {"nope.jsonl": None, "empty.jsonl": "", "words.jsonl": '{"prompt": "hi there"}\n'}
    messages = {"nope.jsonl": "no such file", "empty.jsonl": "no requests", "words.jsonl": "max_tokens"}
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        args = ["sim", "simulate", "--model", tiny_model, "--gpu", host, "--lengths", str(tmp_path / name)]
        assert main(args) == 2
        assert messages[name] in capsys.readouterr().err


def test_conditional_pd_in_the_simulator(tiny_model: str, tmp_path: Path):
    host = write(tmp_path / "host.json", HOST)
    profile = write(tmp_path / "profile.json", profile_doc(STEPS, handoff_fixed_s=0.02))
    lengths = bimodal(tmp_path / "observed.jsonl")
    pd = ["--design", "pd", "--lengths", lengths]
    on_cost = simulate_json(profile, host, tiny_model, *pd)
    always = simulate_json(profile, host, tiny_model, *pd, "--pd-decision", "always")
    rows_cost = [r for r in finished(on_cost)["rows"] if "remote_fraction" in r]
    rows_always = [r for r in finished(always)["rows"] if "remote_fraction" in r]
    # idle (0.2 req/s): remote only where the prompt outweighs the handoff (break-even
    # 0.02 s / (2 x 20 us + ...) ~ 400 tokens): the 3,000-token tenth
    assert 0.05 <= rows_cost[0]["remote_fraction"] <= 0.2
    assert rows_always[0]["remote_fraction"] == 1.0


# ---- the tiers around the engines ----------------------------------------------------------


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a one-core engine beside one of every core")
def test_calibrate_measures_the_tiers_cpu_and_engines_of_two_thread_counts(
    tiny_model: str, tmp_path: Path, monkeypatch, capsys
):
    """`--proxy` reads `up`'s proxy and render tier CPU (their process_cpu_seconds_total)
    around loads of known shape; `--engine` twice measures engines of two thread counts
    (an `engine` on every core, and `up`'s decode pinned to one); `--pd` the handoff. The engines' and
    the render tier's /metrics need the deployment's token, and without it calibrating says so."""
    host = write(tmp_path / "host.json", HOST)
    out = tmp_path / "profile.json"
    port = free_port()
    token = secrets.token_urlsafe(16)
    cpus = sorted(os.sched_getaffinity(0))
    args = ["up", tiny_model, "--port", str(port), "--prefill", "1", "--decode", "1", "--num-blocks", "256",
            "--pd-decision", "threshold", "--min-prefill-tokens", "64",
            "--cpu-affinity", f"decode-0={cpus[0]}", "--cpu-affinity", f"prefill-0={cpus[-1]}"]  # fmt: skip
    env = {INTERNAL_TOKEN_ENV: token, **REFERENCE_KERNELS}
    engine_port = free_port()
    engine_args = ["engine", tiny_model, "--port", str(engine_port), "--log-level", "warning"]
    with (
        running_servers([(args, port)], timeout=180, env=env) as (base,),
        running_servers([(engine_args, engine_port)], env=REFERENCE_KERNELS) as (engine,),
    ):
        workers = httpx.get(f"{base}/workers", timeout=10).json()
        urls = {w["role"]: w["url"] for w in workers["workers"]}
        probe = [
            "--probe-prefill",
            "32,512,1024",
            "--probe-batches",
            "1,4",
            "--probe-contexts",
            "64",
            "--repeats",
            "2",
        ]
        calibrate = ["sim", "calibrate", "--engine", engine, "--engine", urls["decode"],
                     "--proxy", base, "--pd", base, "--model", tiny_model, "--gpu", host, "--out", str(out),
                     *probe]  # fmt: skip
        monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
        assert main(calibrate) == 2
        assert "SPLITSERVE_INTERNAL_TOKEN" in capsys.readouterr().err
        monkeypatch.setenv(INTERNAL_TOKEN_ENV, token)
        twice = ["sim", "calibrate", "--engine", urls["decode"], "--engine", urls["decode"],
                 "--model", tiny_model, "--gpu", host, "--out", str(out)]  # fmt: skip
        assert main(twice) == 2
        assert "each --engine must run on a different number of threads" in capsys.readouterr().err
        assert main(calibrate) == 0, capsys.readouterr().err
        routed = httpx.get(f"{base}/metrics", timeout=10).text
    profile = load_profile(str(out))
    assert profile.threads == len(cpus) and set(profile.measured_steps()) == {1, len(cpus)}
    assert profile.measured_steps()[1].prefill_s(1024) > profile.measured_steps()[1].prefill_s(32) > 0
    cpu = profile.cpu
    assert cpu is not None
    # every request and every streamed token costs the tiers CPU; the loads sent prompts
    # through the prefill worker too
    assert cpu.cpu_s_per_request > 0 and cpu.cpu_s_per_token > 0, cpu
    assert cpu.cpu_s_per_request + cpu.cpu_s_per_remote_request > 0, cpu
    # the one-thread engines' own processes, apart: decode's API streams every request,
    # the prefill worker's takes in and pushes the KV of each it prefills
    assert cpu.engine_s_per_request + cpu.engine_s_per_step + cpu.engine_s_per_token > 0, cpu
    assert cpu.prefill_engine_s_per_request > 0, cpu
    assert 'splitserve_proxy_requests_total{path="pd_push"}' in routed
    # `--pd`: the handoff the proxy measured, and its cost per byte
    assert profile.handoff_fixed_s is not None and 0 <= profile.handoff_fixed_s < 1.0, profile
    assert profile.handoff_s_per_byte is not None and profile.handoff_s_per_byte >= 0
    assert "process_cpu_seconds_total" in routed
    output = capsys.readouterr().out
    assert "tiers' CPU" in output and "engines' own CPU" in output and "on 1 thread(s)" in output
