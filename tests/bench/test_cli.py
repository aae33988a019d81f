"""`splitserve bench` through its command line, as a user runs it."""

from __future__ import annotations

import itertools
import json

import pytest

from splitserve.cli import main
from tests.bench.conftest import fake_server, reset_stats, server_stats, splitserve_bench
from tests.conftest import free_port


@pytest.fixture(scope="module")
def flaky_server():
    """Fails every 6th request; 10 ms TTFT, 1 ms between tokens."""
    with fake_server("--ttft", "0.01", "--itl", "0.001", "--fail-every", "6") as url:
        yield url


def test_sweep_writes_json_plot_and_summary(flaky_server, tiny_model, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    reset_stats(flaky_server)
    proc = splitserve_bench(
        "--url", flaky_server, "--tokenizer", tiny_model, "--rate", "20,80", "--num-requests", "10",
        "--warmup", "1", "--input-len", "24", "--output-len", "4:12", "--slo", "ttft=60s,gap=30s",
        "--json", str(out), "--plot", str(png), "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert server_stats(flaky_server)["requests"] == 22
    data = json.loads(out.read_text())
    assert data["settings"]["model"] == "fake-model"  # asked the server's /v1/models
    assert data["settings"]["exact_lengths"] is True
    assert data["slos"] == ["ttft=60s,gap=30s"]
    assert [level["summary"]["rate"] for level in data["levels"]] == [20.0, 80.0]
    failed = 0
    for level in data["levels"]:
        summary, requests = level["summary"], level["requests"]
        assert len(requests) == 11 and sum(not r["warmup"] for r in requests) == summary["requests"] == 10
        for r in requests:
            if r["error"] is None:
                assert 0 < r["ttft"] < r["e2e"] and 4 <= r["output_tokens"] <= 12
                gaps = [b - a for a, b in itertools.pairwise(r["chunk_times"])]
                assert sum(gaps) == pytest.approx(r["e2e"] - r["ttft"])
        failed += summary["failed"] + sum(1 for r in requests if r["warmup"] and r["error"])
        assert summary["completed"] + summary["failed"] == 10
        # bounds no load can miss: only the failed requests miss them
        assert summary["attainment"]["ttft=60s,gap=30s"] == summary["completed"] / 10
    assert failed == 3  # requests 6, 12 and 18 of the 22 the server saw
    assert data["required_attainment"] == 0.9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput (DistServe, 90% attainment)" in proc.stdout
    assert "HTTP 500" in proc.stdout  # errors are reported


def test_compare_prints_side_by_side_ratios(steady_server, tmp_path, capsys):
    # In-process through the CLI entry point: a subprocess per run would cost seconds of imports.
    paths = []
    for name, output_len in (("a", "4"), ("b", "8")):
        path = tmp_path / f"{name}.json"
        assert main([
            "bench", "--url", steady_server, "--model", "fake-model", "--rate", "inf", "--num-requests", "6",
            "--output-len", output_len, "--input-len", "8", "--json", str(path), "--quiet",
        ]) == 0  # fmt: skip
        paths.append(str(path))
    capsys.readouterr()
    assert main(["bench", "--compare", *paths]) == 0
    out = capsys.readouterr().out
    assert "B / A" in out and "goodput (DistServe)" in out
    assert "x" in out.split("output tokens/s")[1].split("\n")[0]  # a ratio on that row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "fast"], "bad --rate"),
        (["--rate", "4,2"], "increasing order"),
        (["--rate", "0"], "must be positive"),
        (["--slo", "ttft=2"], "unit"),
        (["--slo", "speed=2s"], "bad SLO term"),
        (["--output-len", "9:3"], "bad length"),
        (["--attainment", "150%"], "bad --attainment"),
        (["--arrival", "gamma", "--burstiness", "0"], "burstiness"),
        (["--duration", "5", "--rate", "inf"], "concurrency cap"),
        (["--tokenizer", "/nonexistent"], "no tokenizer.json"),
        (["--compare", "/nonexistent.json", "/nonexistent.json"], "cannot read"),
        (["--json", "/nonexistent/dir/out.json"], "directory does not exist"),
        (["--turns", "2", "--dataset", "x.jsonl"], "cannot be combined"),
    ],
)
def test_bad_arguments_get_a_clear_message(args, message, capsys):
    # In-process through the CLI entry point (a subprocess each would cost a second of imports).
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", *args]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_without_model_is_a_clear_error():
    proc = splitserve_bench("--url", "http://127.0.0.1:9", "--num-requests", "1")
    assert proc.returncode == 2 and "cannot reach" in proc.stderr and "Traceback" not in proc.stderr


def test_dataset_replay(steady_server, tmp_path):
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text(
        '{"prompt": "hello world", "max_tokens": 3}\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    out = tmp_path / "replay.json"
    assert main([
        "bench", "--url", steady_server, "--dataset", str(dataset), "--rate", "inf", "--num-requests", "4",
        "--warmup", "0", "--output-len", "5", "--json", str(out), "--quiet",
    ]) == 0  # fmt: skip
    requests = json.loads(out.read_text())["levels"][0]["requests"]
    assert sorted(r["output_tokens"] for r in requests) == [3, 3, 5, 5]
    assert all(r["error"] is None for r in requests)


def test_refused_connections_are_reported_and_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert (
        main(["bench", "--url", url, "--model", "m", "--num-requests", "3", "--rate", "inf", "--quiet"]) == 1
    )
    captured = capsys.readouterr()
    assert "errors: connect x3" in captured.out  # the 3 measured requests (warm-up not counted)
    assert "no request succeeded" in captured.err
