"""`splitserve bench` against `splitserve serve` on the tiny model, started by the test."""

from __future__ import annotations

import importlib.util
import itertools
import json

import httpx
import pytest

from tests.bench.conftest import splitserve_bench
from tests.conftest import free_port, running_server

pytestmark = pytest.mark.skipif(
    not importlib.util.find_spec("splitserve.service.app"),
    reason="`splitserve serve` (splitserve.service.app) is not in this build",
)


@pytest.fixture(scope="module")
def serve_url(tiny_model):
    port = free_port()
    with running_server(["serve", tiny_model, "--host", "127.0.0.1", "--port", str(port)], port) as url:
        yield url


def run_json(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = splitserve_bench(*args, "--json", str(out), "--quiet", timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def check_level(level: dict, measured: int, output_tokens: int | None = None) -> None:
    summary, requests = level["summary"], level["requests"]
    assert summary["requests"] == measured == sum(not r["warmup"] for r in requests)
    assert summary["completed"] + summary["failed"] == measured
    for r in requests:
        if r["error"] is None:
            assert 0 < r["ttft"] < r["e2e"]
            times = r["chunk_times"]
            assert sum(b - a for a, b in itertools.pairwise(times)) == pytest.approx(r["e2e"] - r["ttft"])
            if output_tokens is not None:
                assert r["output_tokens"] == output_tokens  # ignore_eos honoured, usage reported


def test_poisson_run_and_sweep_against_splitserve_serve(serve_url, tiny_model, tmp_path):
    common = ("--url", serve_url, "--tokenizer", tiny_model, "--input-len", "48", "--output-len", "12")
    data = run_json(tmp_path, "poisson", *common, "--rate", "20", "--num-requests", "8", "--warmup", "1")
    (level,) = data["levels"]
    check_level(level, 8, output_tokens=12)
    assert level["summary"]["failed"] == 0
    # Exact prompts: every request has the same prompt length as the server counts it
    # (48 content tokens plus the chat template's fixed overhead).
    assert len({r["input_tokens"] for r in level["requests"]}) == 1
    assert level["requests"][0]["input_tokens"] >= 48

    # The completions endpoint adds no template: the server counts exactly --input-len tokens.
    sweep = run_json(
        tmp_path, "sweep", *common, "--endpoint", "completions", "--rate", "5,40", "--num-requests", "6",
        "--warmup", "0",
    )  # fmt: skip
    assert [lvl["summary"]["rate"] for lvl in sweep["levels"]] == [5.0, 40.0]
    for lvl in sweep["levels"]:
        check_level(lvl, 6, output_tokens=12)
        assert {r["input_tokens"] for r in lvl["requests"]} == {48}
    assert set(sweep["goodput_distserve"]) == {"ttft=2s,tpot=30ms", "ttft=2s,gap=100ms"}


def test_server_errors_are_reported_not_fatal(serve_url, tmp_path):
    # One line too long for the tiny model's 4096-token context: the server refuses it (400).
    dataset = tmp_path / "chats.jsonl"
    lines = [{"prompt": "hello there " * 3000, "max_tokens": 4}] + [
        {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 6} for i in range(3)
    ]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    data = run_json(
        tmp_path, "errors", "--url", serve_url, "--dataset", str(dataset), "--rate", "inf",
        "--num-requests", "8", "--warmup", "0",
    )  # fmt: skip
    (level,) = data["levels"]
    check_level(level, 8, output_tokens=None)
    assert level["summary"]["errors"] == {"HTTP 400": 2}
    assert level["summary"]["completed"] == 6
    assert all(r["output_tokens"] == 6 for r in level["requests"] if r["error"] is None)


def test_multi_turn_sessions_with_shared_prefixes(serve_url, tiny_model, tmp_path):
    data = run_json(
        tmp_path, "turns", "--url", serve_url, "--tokenizer", tiny_model, "--turns", "2",
        "--prefix-len", "32", "--num-prefix-groups", "2", "--input-len", "16", "--output-len", "8",
        "--rate", "inf", "--num-requests", "4", "--warmup", "0",
    )  # fmt: skip
    (level,) = data["levels"]
    check_level(level, 4, output_tokens=8)
    by_turn = {(r["session"], r["turn"]): r["input_tokens"] for r in level["requests"]}
    assert sorted(by_turn) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for session in (0, 1):
        # The second turn resends the first prompt, the 8-token answer and 16 new tokens.
        assert by_turn[session, 1] >= by_turn[session, 0] + 8 + 16
    assert by_turn[0, 0] == by_turn[1, 0]  # same lengths: 32 prefix + 16 tokens + the template


def test_without_tokenizer_the_bench_finds_it_through_the_models_root(serve_url, tiny_model, tmp_path):
    # splitserve's /v1/models names the model by its directory's name (not a path), so only
    # the entry's `root` (as vLLM's) leads the bench to the tokenizer: exact prompt lengths.
    (model,) = httpx.get(serve_url + "/v1/models").json()["data"]
    assert model["root"] == tiny_model and model["parent"] is None and model["id"] != tiny_model
    data = run_json(
        tmp_path, "root", "--url", serve_url, "--endpoint", "completions", "--input-len", "40",
        "--output-len", "2", "--rate", "inf", "--num-requests", "3", "--warmup", "0",
    )  # fmt: skip
    assert data["settings"]["exact_lengths"] is True
    (level,) = data["levels"]
    assert {r["input_tokens"] for r in level["requests"]} == {40}


def test_prints_the_phases_of_the_slowest_requests(serve_url, tiny_model, tmp_path):
    """`splitserve bench` asks a splitserve server for each request's timeline, keeps it in
    the JSON and prints the slowest requests' phases."""
    out = tmp_path / "timeline.json"
    proc = splitserve_bench(
        "--url", serve_url, "--tokenizer", tiny_model, "--input-len", "24", "--output-len", "4",
        "--rate", "inf", "--num-requests", "3", "--warmup", "0", "--json", str(out), "--quiet",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    requests = json.loads(out.read_text())["levels"][0]["requests"]
    for r in requests:
        assert r["timeline"]["prefill"] > 0 and all(v >= 0 for v in r["timeline"].values())
    assert "slowest requests by TTFT" in proc.stdout
    assert "prefill_queue" in proc.stdout and "derender" in proc.stdout
