"""`splitserve sim ...` through a subprocess with --json: the seed's figures, plots, errors.
The commands run concurrently (each is a separate process) to keep the suite fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_sim(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "sim", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, object, str]]:
    tmp = tmp_path_factory.mktemp("simcli")
    trace = tmp / "trace.csv"
    trace.write_text(
        "arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 2.5},2000,64\n" for i in range(20))
    )
    commands = {
        "kv": ["kv"],
        "kv_qwen": [
            "kv",
            "--model",
            "Qwen2.5-7B",
            "--gpu",
            "L40S",
            "--tp",
            "1",
            "--tokens",
            "8192",
            "--link-gbps",
            "200",
            "--link-gbps",
            "400",
            "--link-gbps",
            "3200",
        ],
        "roofline": ["roofline", "--decode", "16"],
        "scenario": ["scenario"],
        "multiturn": ["multiturn"],
        "tp": ["tp"],
        "cuts": ["cuts"],
        "simulate": [
            "simulate",
            "--preset",
            "seed",
            "--rates",
            "0.2,0.4",
            "--seeds",
            "3",
            "--design",
            "collocated",
            "--design",
            "pd:1.3",
            "--plot",
            str(tmp / "cdf.png"),
            "--records",
            str(tmp / "records.jsonl"),
        ],
        "goodput": [
            "goodput",
            "--preset",
            "seed",
            "--slo",
            "average",
            "--rates",
            "0.2,0.4,0.6,0.8",
            "--plot",
            str(tmp / "att.png"),
        ],
        "sweep": [
            "sweep-chunk",
            "--preset",
            "seed",
            "--rates",
            "1.0",
            "--budgets",
            "512,2048",
            "--seeds",
            "2",
        ],
        "beyond": ["beyond", "--rates", "2.0", "--seeds", "2"],
        "plan": [
            "plan",
            "--rate",
            "0.5",
            "--max-gpus",
            "3",
            "--budgets",
            "2048",
            "--slo",
            "both",
            "--transfer-s",
            "0.02",
            "--iters",
            "2",
            "--max-requests",
            "800",
        ],
        "seed_arrivals": ["reproduce", "--seed-arrivals"],
        "cpu_tier": ["cpu-tier"],
        "payload": ["payload"],
        "trace": [
            "simulate",
            "--trace",
            str(trace),
            "--rates",
            "0.4",
            "--seeds",
            "1",
            "--design",
            "collocated",
        ],
        "turns": [
            "simulate",
            "--turns",
            "3",
            "--prompt",
            "4000",
            "--output",
            "300",
            "--requests",
            "30",
            "--rates",
            "0.05",
            "--seeds",
            "1",
            "--design",
            "pd:0.02",
            "--bidirectional",
        ],
        "synthetic": ["calibrate", "--synthetic", "0.4,0.7,3"],
        "reproduce": ["reproduce"],
        "bad_model": ["roofline", "--model", "gpt-9"],
        "bad_gpu": ["simulate", "--gpu", "TPU-v9", "--rates", "0.4"],
        "bad_rate": ["goodput", "--rates=-0.4,1"],
        "bad_config": ["kv", "--model", str(tmp / "missing" / "config.json")],
    }
    procs = {name: run_sim([*args, "--json"]) for name, args in commands.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        data = json.loads(stdout) if p.returncode == 0 and name != "synthetic" else stdout
        out[name] = (p.returncode, data, stderr)
    samples = tmp / "samples.json"
    samples.write_text(out["synthetic"][1])
    p = run_sim(["calibrate", str(samples), "--json"])
    stdout, stderr = p.communicate(timeout=60)
    out["calibrate"] = (p.returncode, json.loads(stdout) if p.returncode == 0 else stdout, stderr)
    out["tmp"] = (0, tmp, "")
    return out


def ok(runs, name):
    rc, data, err = runs[name]
    assert rc == 0, err
    return data


def test_cli_closed_form_figures(runs):
    kv = ok(runs, "kv")
    assert kv["kv_bytes_per_token"] == 327_680 and kv["mha_kv_bytes_per_token"] == 2560 * 1024
    assert round(kv["links"][0]["bulk_transfer_s"] * 1e3, 1) == 65.5
    assert round(kv["links"][0]["layerwise_exposed_s"] * 1e3, 1) == 0.8
    qwen = ok(runs, "kv_qwen")
    assert qwen["kv_bytes_per_token"] == 56 * 1024 and round(qwen["request_bytes"] / 1e6) == 470
    assert [round(x["bulk_transfer_s"] * 1e3, 1) for x in qwen["links"]] == [18.8, 9.4, 1.2]
    roof = ok(runs, "roofline")
    assert round(roof["ridge"]) == 419
    assert [round(r["ideal_s"] * 1e3, 1) for r in roof["rows"][:5]] == [332.5, 83.1, 16.9, 17.5, 20.7]
    assert [round(r["intensity"]) for r in roof["rows"][:5]] == [8513, 2128, 1, 2, 52]
    assert len(roof["rows"]) == 6 and roof["rows"][5]["bound"] == "memory"
    scen = ok(runs, "scenario")
    assert [(round(r["n_ttft_s"] * 1e3), round(r["ab_worst_stall_s"] * 1e3)) for r in scen] == [
        (731, 710),
        (737, 194),
        (763, 51),
        (771, 24),
        (2053, 24),
    ]
    mt = ok(runs, "multiturn")
    assert [round(r["one_way_s"] * 1e3) for r in mt] == [328, 89, 92, 94, 96, 99]
    tp = ok(runs, "tp")
    assert [round(r["seed_model_ttft_s"] * 1e3) for r in tp["prefill"]] == [721, 408]
    assert tp["decode"][0]["batch"] == 109 and tp["decode"][0]["limited_by"] == "memory"
    cuts = ok(runs, "cuts")
    assert round(cuts["af_over_kv"]) == 24 and round(cuts["ssm"]["break_even_tokens"]) == 777


def test_cli_simulated_figures(runs):
    sim = ok(runs, "simulate")
    rows = {(r["design"], r["rate"]): r for r in sim["rows"]}
    assert 0.160 <= rows[("collocated", 0.4)]["itl_p99_s"] <= 0.190
    assert 2.0 <= rows[("P/D, 1.3 s transfer", 0.4)]["ttft_median_s"] <= 2.1
    assert rows[("P/D, 1.3 s transfer", 0.4)]["itl_p99_s"] < 0.035
    gp = {r["design"]: r["goodput"] for r in ok(runs, "goodput")["results"]}
    assert gp == {"collocated": 0.2, "P/D, 1.3 s transfer": 0.0, "P/D, 20 ms transfer": 0.6}
    sweep = {r["budget"]: r for r in ok(runs, "sweep")["rows"]}
    assert (
        round(sweep[512]["worst_gap_s"] * 1e3) in (50, 51, 52)
        and round(sweep[2048]["worst_gap_s"] * 1e3) == 194
    )
    beyond = {r["variant"]: r["itl_p99_s"] for r in ok(runs, "beyond")["rows"]}
    assert beyond["all of the above (realistic preset)"] > beyond["seed's model"]
    plan = ok(runs, "plan")
    assert plan["slos"] == ["ttft=2s,tpot=30ms", "ttft=2s,gap=100ms"]  # --slo both: both judged
    best = plan["plans"][0]
    assert {"prefill", "decode", "collocated", "encoder"} <= best.keys()
    assert (best["prefill"], best["decode"], best["collocated"], best["encoder"]) == (1, 2, 0, 0)
    assert best["attainment"] >= 0.9 and best["goodput"] >= 0.5 and best["headroom"] >= 0 and best["binding"]
    records = [json.loads(line) for line in (runs["tmp"][1] / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 3 * 100  # rates x designs x seeds x requests
    first = records[0]
    assert first["design"] == "collocated" and len(first["itl_s"]) == first["output_tokens"] - 1 == 255
    assert max(first["itl_s"]) == pytest.approx(first["worst_gap_s"])
    assert ok(runs, "trace")["rows"][0]["requests"] == 20
    assert ok(runs, "turns")["rows"][0]["ttft_median_s"] < 0.3
    tmp = runs["tmp"][1]
    for png in ("cdf.png", "att.png"):
        assert (tmp / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reproduce_every_seed_figure(runs):
    rep = ok(runs, "reproduce")
    assert rep["failed"] == [] and len(rep["figures"]) >= 40
    names = {f["name"] for f in rep["figures"]}
    assert {"KV per token, Llama-3.1-70B", "goodput, average SLO, P/D 20 ms"} <= names


def test_cli_calibrate_round_trip(runs):
    cal = ok(runs, "calibrate")
    assert cal["compute"] == pytest.approx(0.4, rel=0.05) and cal["bandwidth"] == pytest.approx(0.7, rel=0.05)
    assert cal["overhead_s"] == pytest.approx(0.003, abs=0.0007)


def test_cli_bad_input_exits_nonzero_with_a_message(runs):
    for name, needle in [
        ("bad_model", "unknown model 'gpt-9'"),
        ("bad_gpu", "unknown GPU 'TPU-v9'"),
        ("bad_rate", "rates must be > 0"),
        ("bad_config", "no such file"),
    ]:
        rc, _, err = runs[name]
        assert rc != 0 and needle in err, (name, err)
        assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["calibrate"], "give a JSON file"),
        (["goodput", "--slo", "custom", "--rates", "0.4"], "needs at least one"),
        (["simulate", "--design", "hybrid", "--rates", "0.4"], "unknown design"),
        (["simulate", "--prompt", "weird:3", "--rates", "0.4"], "bad lengths"),
        (["simulate", "--budget", "0", "--rates", "0.4"], "--budget must be > 0"),
        (["plan", "--rate", "0"], "--rate must be > 0"),
        (["cuts", "--moe-model", "Qwen2.5-7B"], "not a mixture-of-experts"),
    ],
)
def test_cli_errors_in_process(argv, needle, capsys, tmp_path):
    assert main(["sim", *argv, "--json"]) != 0
    assert needle in capsys.readouterr().err


def test_cli_calibrate_bad_file(capsys, tmp_path):
    bad = tmp_path / "steps.json"
    bad.write_text(json.dumps([{"kind": "prefill", "num_tokens": 10}]))
    assert main(["sim", "calibrate", str(bad)]) == 2
    assert "step_time_s" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["sim", "goodput", "--rates", "a,b"])
    assert exc.value.code != 0


def test_a_moe_config_without_the_experts_width_is_a_clear_error(capsys, tmp_path):
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 8, "num_experts_per_tok": 2}))
    assert main(["sim", "kv", "--model", str(tmp_path / "config.json"), "--json"]) == 2
    assert "moe_intermediate_size" in capsys.readouterr().err
