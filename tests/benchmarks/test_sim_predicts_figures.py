"""benchmarks/bench_sim_predicts_bench.py's figures of a saved bench run, the ones its
prediction and its `--repeat` noise floor are both counted on, and how it measures and
predicts a layout in several rounds."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling modules
    return importlib.import_module("bench_sim_predicts_bench")


@pytest.fixture
def figures_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("sim_predicts_figures")


def level(rate: float, ttft_ms: float, itl_ms: float, attained: float) -> dict:
    ttft = {"p50": ttft_ms / 1e3, "p90": 2 * ttft_ms / 1e3}
    itl = {"p50": itl_ms / 1e3, "p90": 2 * itl_ms / 1e3, "p99": 3 * itl_ms / 1e3}
    return {
        "load": {"rate": rate},
        "summary": {"ttft": ttft, "itl": itl, "attainment": {"ttft=500ms": attained}},
    }


def run(goodput: float, *levels: dict) -> dict:
    return {"slos": ["ttft=500ms"], "levels": list(levels), "goodput_distserve": {"ttft=500ms": goodput}}


def test_a_runs_figures_are_named_by_rate_and_in_ms_or_percent(figures_module):
    figures = figures_module.measured_figures(run(4.0, level(4, 40, 6, 1.0), level(12.5, 70, 16, 0.0)))
    assert figures == {
        "4 TTFT p50 ms": pytest.approx(40),
        "4 TTFT p90 ms": pytest.approx(80),
        "4 ITL p50 ms": pytest.approx(6),
        "4 ITL p90 ms": pytest.approx(12),
        "4 ITL p99 ms": pytest.approx(18),
        "4 attainment ttft=500ms %": pytest.approx(100),
        "12.5 TTFT p50 ms": pytest.approx(70),
        "12.5 TTFT p90 ms": pytest.approx(140),
        "12.5 ITL p50 ms": pytest.approx(16),
        "12.5 ITL p90 ms": pytest.approx(32),
        "12.5 ITL p99 ms": pytest.approx(48),
        "12.5 attainment ttft=500ms %": 0.0,
        "goodput ttft=500ms": 4.0,
    }


def test_two_runs_errors_count_only_figures_measured_non_zero(figures_module):
    first = figures_module.measured_figures(run(4.0, level(4, 40, 6, 0.0)))
    again = figures_module.measured_figures(run(12.0, level(4, 44, 5.4, 0.5)))
    errors = figures_module.relative_errors(again, first)
    assert "4 attainment ttft=500ms %" not in errors  # measured 0 the first time: no ratio
    assert errors["4 TTFT p50 ms"] == pytest.approx(0.10)
    assert errors["4 ITL p99 ms"] == pytest.approx(0.10)
    assert errors["goodput ttft=500ms"] == pytest.approx(2.0)
    assert len(errors) == 6


def test_serve_meets_a_request_with_its_own_api_where_up_has_its_proxy(script):
    """`serve` has no proxy or render tier: its prompt reaches the engine after its
    tokenizing and its API's own time (the profile's `api_s_per_request`), and the tiers'
    CPU is not charged to it."""
    from splitserve.sim import Deployment, load_gpu, load_model
    from splitserve.sim.profile import CpuCosts

    cpu = CpuCosts(
        render_s_per_request=0.001,
        render_s_per_token=1e-6,
        proxy_s_per_request=0.008,
        api_s_per_request=0.004,
        cpu_s_per_request=0.005,
        cpu_s_per_token=0.001,
    )
    up = Deployment(load_model("Qwen2.5-7B"), load_gpu("L40S"), cpu=cpu)
    serve = importlib.import_module("sim_predicts_measure").serve_deployment(up, 256)
    assert up.cpu.delay_s(256) == pytest.approx(0.001 + 256e-6 + 0.008)
    assert serve.cpu.delay_s(256) == pytest.approx(0.001 + 256e-6 + 0.004)
    assert serve.cpu.cpu_s_per_request == serve.cpu.cpu_s_per_token == 0.0
    assert serve.sched.scheduler.long_prefill_token_threshold == 0


def test_the_bench_clients_cpu_costs_the_engine_beside_it_a_second_per_second(script):
    """The client reads each streamed token on one core: a two-thread engine it lands beside
    loses the client's time once (not twice, as for the tiers' many threads), and with a
    second engine idle it loses nothing (its core runs the client)."""
    import numpy as np

    from splitserve.sim import Deployment, Workload, load_gpu, load_model, simulate
    from splitserve.sim.profile import CpuCosts

    one = Workload.open_loop([0.0], [256], [64])
    model, gpu = load_model("Qwen2.5-7B"), load_gpu("L40S")
    dep = Deployment(model, gpu, replicas=1, routing="least_loaded", cpu=CpuCosts())
    base = np.median(simulate(dep, one).gaps[0])
    for threads in (1.0, 2.0):
        client = script.with_client_cpu(replace(dep, own_loss=threads), 0.001)
        assert np.median(simulate(client, one).gaps[0]) == pytest.approx(base + 0.001, abs=1e-9)
        assert np.median(simulate(replace(client, replicas=2), one).gaps[0]) == pytest.approx(base, abs=1e-9)


def test_the_simulated_arrivals_are_the_ones_bench_sent(figures_module):
    """bench sends request 0 at once and each next one a seeded gap later: request i of
    the simulated level arrives when bench sent request i."""
    import random

    from splitserve.goodput import interarrival_times

    load = {"rate": 5.0, "seed": 3, "arrival": "poisson", "burstiness": 1.0}
    requests = [{"request_id": i, "input_tokens": 100 + i, "output_tokens": 8} for i in range(4)]
    wl = figures_module.workload_of({"load": load, "requests": requests})
    gaps = interarrival_times(5.0, random.Random(3), "poisson", 1.0)
    sent = [0.0]
    for _ in range(3):
        sent.append(sent[-1] + next(gaps))
    assert list(wl.arrival) == pytest.approx(sent, abs=1e-12)
    assert list(wl.prompt) == [100, 101, 102, 103]


def test_two_collocated_engines_are_measured_as_the_planner_starts_them(monkeypatch):
    """`--layouts "up 2 collocated"`: `up --prefill 0 --decode 2`, one engine a core, pinned
    as `up --plan` pins its pick (the layout the planner picks on two cores)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    measure = importlib.import_module("sim_predicts_measure")
    command, layout = measure.layout_of("up 2 collocated", [0, 1])
    assert command == ["up", "--prefill", "0", "--decode", "2"]
    assert layout.label() == "2 decode (collocated)"
    assert layout.cpu_affinity([0, 1]) == ["decode-0=0", "decode-1=1"]
    assert "up 2 collocated" in measure.LAYOUTS


def step_lines(speeds: list[float], model) -> list[dict]:
    """One decode step a speed (a multiple of `model`'s time), back to back on one engine."""
    lines, cpu, t = [], 0.0, 0.0
    for speed in speeds:
        cost = speed * float(model.decode_s(1, 300))
        cpu, t = cpu + cost, t + cost
        lines.append({"pid": 3, "role": "decode", "t": t, "step_s": cost, "tokens": 1, "running": 1,
                      "thread_cpu_s": cpu, "decodes": 1, "context": 300, "chunks": [], "threads": 1,
                      "borrowed": False})  # fmt: skip
    return lines


def test_each_layout_is_retimed_by_its_engines_warm_up_steps_alone(script, tmp_path: Path, capsys):
    """The unmeasured run before a layout's measurement re-times the profile it is
    predicted with; the measured run's own steps do not (nor does a log without shapes)."""
    from splitserve.protocol.step_record import read_step_log
    from splitserve.sim.profile import EngineProfile
    from splitserve.sim.step_model import StepModel

    model = StepModel(0.002, 20e-6, 4e-9, (1, 4), (0.004, 0.006), 1e-7)
    profile = EngineProfile(model, threads=1)
    lines = step_lines([2.0] * 20 + [5.0] * 20, model)  # 20 warm-up steps at 2x, 20 measured at 5x
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    measured = {"measured_from": lines[19]["t"] + 1e-6}
    run = {"levels": [{"load": {"rate": 4.0}}, {"load": {"rate": 8.0}}]}
    fits = script.level_fits(measured, read_step_log(log), None, run, "per-level")
    assert len(fits) == 2 and fits[0] is fits[1]  # one warm-up run: one fit for every level
    retimed = script.layout_profile(profile, "up 1P+1D", fits[0])
    assert float(retimed.steps.decode_s(1, 300)) == pytest.approx(2.0 * float(model.decode_s(1, 300)))
    out = capsys.readouterr().out
    assert "1 thread(s): decode B=1: x2.00" in out
    # and what its steps waited for a core (here nothing beyond their CPU), unless told not to
    assert retimed.waits is not None and retimed.waits.kinds["decode"][0].per_compute == 0.0
    assert "decode waits (others idle): 0.000 s/s of compute" in out
    speed_only = script.layout_profile(profile, "up 1P+1D", fits[0], waits=False)
    assert speed_only.waits is None and speed_only.steps == retimed.steps
    itself = script.level_fits(measured, read_step_log(log), None, run, "measured")[0]
    assert {r.step_s for r in itself.records} == {lines[20]["step_s"]}  # --fit-on-measured: the 5x steps
    capsys.readouterr()
    shapeless = [{k: v for k, v in line.items() if k != "decodes"} for line in lines]
    log.write_text("".join(json.dumps(line) + "\n" for line in shapeless))
    (fit, _) = script.level_fits(measured, read_step_log(log), None, run, "warm-up")
    assert script.layout_profile(profile, "up 1P+1D", fit) is profile
    assert "the profile as calibrated" in capsys.readouterr().out


def test_a_level_measured_per_level_is_predicted_from_the_warm_up_just_before_it(
    script, tmp_path: Path, capsys
):
    """`--per-level`: warm-up at 4 req/s, 4 req/s, warm-up at 8 req/s, 8 req/s. With
    `--each-level` (how "per-level") each level is re-timed by its own warm-up's steps and
    its path fitted from its requests; by default (how "warm-up"), every level by every
    warm-up's steps."""
    from splitserve.protocol.step_record import read_step_log
    from splitserve.sim.profile import EngineProfile
    from splitserve.sim.step_model import StepModel

    model = StepModel(0.002, 20e-6, 4e-9, (1, 4), (0.004, 0.006), 1e-7)
    profile = EngineProfile(model, threads=1)
    lines = step_lines([2.0] * 20 + [9.0] * 20 + [3.0] * 20 + [9.0] * 20, model)
    ends = [lines[i]["t"] + 1e-6 for i in (19, 39, 59, 79)]
    measured = {
        "measured_from": ends[0],
        "warm_up_windows": [[0.0, ends[0]], [ends[1], ends[2]]],
        "level_windows": [[ends[0], ends[1]], [ends[2], ends[3]]],
    }
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    warm_up_run = {"levels": [{"load": {"rate": 4.0}, "n": 0}, {"load": {"rate": 8.0}, "n": 1}]}
    run = {"levels": [{"load": {"rate": 4.0}}, {"load": {"rate": 8.0}}]}
    first, second = script.level_fits(measured, read_step_log(log), warm_up_run, run, "per-level")
    own = [[warm_up_run["levels"][0]], [warm_up_run["levels"][1]]]
    assert [f.run["levels"] for f in (first, second)] == own
    assert "just before 8 req/s" in second.source
    speeds = [
        float(script.layout_profile(profile, "up 1P+1D", fit, waits=False).steps.decode_s(1, 300))
        / float(model.decode_s(1, 300))
        for fit in (first, second)
    ]
    assert speeds == pytest.approx([2.0, 3.0])
    (pooled, again) = script.level_fits(measured, read_step_log(log), warm_up_run, run, "warm-up")
    assert pooled is again and len(pooled.records) == 40 and pooled.run is warm_up_run
    itself = script.level_fits(measured, read_step_log(log), warm_up_run, run, "measured")
    assert [len(fit.records) for fit in itself] == [20, 20] and itself[1].run["levels"] == run["levels"][1:]
    assert {r.step_s for fit in itself for r in fit.records} == {lines[20]["step_s"]}
    capsys.readouterr()


def test_each_levels_warm_up_sends_seconds_of_arrivals_at_its_rate(monkeypatch, tmp_path: Path):
    """`--per-level --warm-up-s 10`: a level's warm-up sends 10 s of its arrivals, or a
    quarter of the measured requests where that is more; warm-ups and levels alternate, each
    with its clock window, and merge into one run each."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    measure = importlib.import_module("sim_predicts_measure")
    sent: list[tuple[str, int, int]] = []

    def bench_run(args, model, url, rate, out, seed, slo, requests):
        sent.append((out.name, seed, requests))
        part = {**run(1.0, level(float(rate), 40, 6, 1.0)), "required_attainment": 0.9}
        out.write_text(json.dumps(part))
        return requests, 0.5

    monkeypatch.setattr(measure, "bench_run", bench_run)
    args = argparse.Namespace(rates=[2.0, 16.0], seed=5, num_requests=80, warm_up_s=10.0)
    spent, windows = measure.bench_levels(args, Path("m"), "url", tmp_path, "serve", "ttft=500ms", (105, 20))
    assert sent == [
        ("serve-warm-up-0.json", 105, 20),
        ("serve-level-0.json", 5, 80),
        ("serve-warm-up-1.json", 106, 160),
        ("serve-level-1.json", 6, 80),
    ]
    assert spent == [(180, 1.0), (160, 1.0)]
    (w0, w1), (l0, l1) = windows["warm_up_windows"], windows["level_windows"]
    assert w0[1] <= l0[0] <= l0[1] <= w1[0] <= w1[1] <= l1[0]
    merged = json.loads((tmp_path / "serve.json").read_text())
    assert [lv["load"]["rate"] for lv in merged["levels"]] == [2.0, 16.0]


def test_runs_of_one_level_each_merge_into_one_run_with_its_goodput(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    measure = importlib.import_module("sim_predicts_measure")
    parts = [
        {**run(4.0, level(rate, 40, 6, attained)), "required_attainment": 0.9}
        for rate, attained in ((4.0, 1.0), (8.0, 0.95), (12.0, 0.5))
    ]
    merged = measure.merged_run(parts)
    assert [lv["load"]["rate"] for lv in merged["levels"]] == [4.0, 8.0, 12.0]
    assert merged["goodput_distserve"] == {"ttft=500ms": 8.0}
    assert merged["slos"] == ["ttft=500ms"] and merged["required_attainment"] == 0.9


def test_a_levels_prediction_is_taken_over_several_simulations_of_its_arrivals(figures_module, monkeypatch):
    """Each level is simulated SIM_RUNS times, with different draws of the steps' spread,
    and its figures are percentiles over every run's requests, not one run's."""
    import numpy as np

    from splitserve.sim import Deployment, load_gpu, load_model, simulate
    from splitserve.sim.step_model import StepModel
    from splitserve.sim.step_waits import StepWaits, WaitTerms

    monkeypatch.setattr(figures_module, "SIM_RUNS", 3)
    none = WaitTerms(0.0, 0.0, 0.0, 100)
    waits = StepWaits({"decode": (none, none)}, {"decode": tuple(np.linspace(0.5, 2.0, 41))})
    steps = StepModel(0.002, 20e-6, 4e-9, (1, 4, 16), (0.004, 0.006, 0.012), 1e-7, 0.001)
    dep = Deployment(load_model("Qwen2.5-7B"), load_gpu("L40S"), steps=steps, waits=waits)
    load = {"rate": 20.0, "seed": 5, "arrival": "poisson", "burstiness": 1.0, "warmup": 2}
    requests = [{"request_id": i, "input_tokens": 256, "output_tokens": 8} for i in range(30)]
    summary = level(20.0, 100.0, 10.0, 1.0)["summary"]
    bench = run(20.0, {"load": load, "requests": requests, "summary": summary}) | {"required_attainment": 0.9}
    results: list = []
    _, errors = figures_module.compare(bench, [dep], results)
    workload = figures_module.workload_of(bench["levels"][0])
    runs = [simulate(dep, workload, seed) for seed in range(3)]
    pooled = np.concatenate([r.ttft[2:] for r in runs])
    assert errors["20 TTFT p50 ms"] == pytest.approx(abs(np.percentile(pooled, 50) * 1e3 / 100.0 - 1))
    assert np.percentile(pooled, 50) != pytest.approx(np.percentile(runs[1].ttft[2:], 50))
    assert len(results) == 1 and np.array_equal(results[0].ttft, runs[0].ttft)  # the first, for the tables


def test_each_layout_is_planned_with_the_scheduler_up_gives_its_engines(monkeypatch):
    """`up`'s engines run with its long-prefill threshold and the measured token budget;
    `serve` with its engine's own scheduler (no cap), one engine of both roles."""
    from splitserve.config import UP_LONG_PREFILL_TOKEN_THRESHOLD
    from splitserve.sim import load_model
    from splitserve.sim.profile import EngineProfile
    from splitserve.sim.step_model import StepModel

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    measure = importlib.import_module("sim_predicts_measure")
    profile = EngineProfile(StepModel(0.002, 20e-6, 4e-9, (1, 4), (0.004, 0.006), 1e-7), threads=2)
    planned = {
        name: measure.planned_deployment(load_model("Qwen2.5-7B"), profile, 1024, name, [0, 1], 256)
        for name in ("serve", "up 1P+1D", "up 2 collocated")
    }
    thresholds = {name: dep.sched.scheduler.long_prefill_token_threshold for name, dep in planned.items()}
    assert thresholds == {
        "serve": 0,
        "up 1P+1D": UP_LONG_PREFILL_TOKEN_THRESHOLD,
        "up 2 collocated": UP_LONG_PREFILL_TOKEN_THRESHOLD,
    }
    assert {dep.sched.scheduler.max_num_batched_tokens for dep in planned.values()} == {1024}
    assert planned["up 1P+1D"].mode == "pd" and planned["serve"].mode != "pd"


def test_each_round_measures_every_layout_starting_one_further_on(monkeypatch, tmp_path: Path):
    """`--repeat 2`: three rounds of every layout, each from a fresh start, a layout's
    rounds spread over the run; the first round is the layout's run, the others its
    repeats, each saved under its own stem."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    measure = importlib.import_module("sim_predicts_measure")
    names = ["serve", "up 1P+1D", "up 2 collocated"]
    assert measure.measure_rounds(names, 2) == [
        (0, "serve"), (0, "up 1P+1D"), (0, "up 2 collocated"),
        (1, "up 1P+1D"), (1, "up 2 collocated"), (1, "serve"),
        (2, "up 2 collocated"), (2, "serve"), (2, "up 1P+1D"),
    ]  # fmt: skip
    started: list[str] = []

    def measure_layout(args, model, dtype, folder, name, stem):
        started.append(stem)
        return {"stem": stem}

    monkeypatch.setattr(measure, "measure_layout", measure_layout)
    monkeypatch.setattr(importlib.import_module("bench_plan_pick"), "calibrate", lambda *a: None)
    monkeypatch.setattr(importlib.import_module("bench_model"), "resolve_bench_model", lambda m: Path(m))
    monkeypatch.setattr(measure.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    args = argparse.Namespace(model="m", layouts=names[:2], repeat=2, budget=512, input_len=256)
    folder = measure.measure(args)
    assert started == ["serve", "up-1P+1D", "up-1P+1D-repeat-1", "serve-repeat-1", "serve-repeat-2",
                       "up-1P+1D-repeat-2"]  # fmt: skip
    saved = json.loads((folder / measure.MEASURED).read_text())
    assert saved["layouts"] == {"serve": {"stem": "serve"}, "up 1P+1D": {"stem": "up-1P+1D"}}
    assert saved["repeats"]["serve"] == [{"stem": "serve-repeat-1"}, {"stem": "serve-repeat-2"}]


def test_a_layout_measured_in_rounds_is_judged_on_the_medians_of_its_rounds(
    script, monkeypatch, tmp_path: Path, capsys
):
    """Predicted and measured, each figure's median over a layout's rounds, so that one
    round in a slow patch moves neither; the noise floor is each round against the median
    of the others."""
    saved = {"model": "m", "dtype": "bf16", "isa": "avx512_bf16", "cpus": [0, 1], "budget": 512}
    saved |= {"input_len": 256, "layouts": {"serve": {"k": 0}}, "repeats": {"serve": [{"k": 1}, {"k": 2}]}}
    (tmp_path / "measured.json").write_text(json.dumps(saved))
    measured = [
        {"4 TTFT p50 ms": 100.0, "goodput ttft=500ms": 4.0},
        {"4 TTFT p50 ms": 250.0, "goodput ttft=500ms": 2.0},  # a round in a slow patch
        {"4 TTFT p50 ms": 104.0, "goodput ttft=500ms": 4.0},
    ]
    predicted = [
        {"4 TTFT p50 ms": 98.0, "goodput ttft=500ms": 4.0},
        {"4 TTFT p50 ms": 300.0, "goodput ttft=500ms": 1.0},
        {"4 TTFT p50 ms": 103.0, "goodput ttft=500ms": 4.0},
    ]
    rounds: list[int] = []

    def predict_round(folder, saved, profile, spec, name, measured_round, choice):
        assert choice.how == "warm-up"  # one profile on every warm-up of a round, unless told
        rounds.append(measured_round["k"])
        return predicted[measured_round["k"]], measured[measured_round["k"]]

    monkeypatch.setattr(script, "predict_round", predict_round)
    monkeypatch.setattr(script, "load_profile", lambda path: None)
    monkeypatch.setattr(script, "load_spec", lambda name: None)
    script.predict(tmp_path)
    out = capsys.readouterr().out
    assert rounds == [0, 1, 2]
    assert "serve: the median of its 3 rounds, predicted and measured" in out
    assert "sim     103.0  bench     104.0    -1.0%" in out
    every = out[out.index("; every layout:") :]
    assert "the must-hold's (TTFT, ITL p50/p90, goodput): within 10% (measured non-zero) 2/2" in every
    # each round against the median of the other two: with three rounds, one round in a slow
    # patch moves the others' median for the two it is not, and the noise floor says so
    round_one = out[out.index("round 1 against the median of the others") : out.index("round 2 against")]
    assert "4 TTFT p50 ms" in round_one and "others     177.0  this     100.0   -43.5%" in round_one
    floor = every[every.index("the noise floor") :]
    assert "every figure: within 10% (measured non-zero) 0/6" in floor


def test_a_folder_measured_before_rounds_is_replayed_as_it_was_saved(script):
    """A folder from before `--repeat N` named no stems and held one repeat, a dict."""
    old = {"layouts": {"up 1P+1D": {"argv": []}}, "repeats": {"up 1P+1D": {"argv": ["again"]}}}
    assert script.layout_rounds(old, "up 1P+1D") == [
        {"stem": "up-1P+1D", "argv": []},
        {"stem": "up-1P+1D-repeat", "argv": ["again"]},
    ]
    new = {"layouts": {"serve": {"stem": "serve"}}, "repeats": {"serve": [{"stem": "serve-repeat-1"}]}}
    assert [r["stem"] for r in script.layout_rounds(new, "serve")] == ["serve", "serve-repeat-1"]
