"""`--step-log FILE` on `serve` and `up`: one record per engine step, which says what the
engine computed (a prompt's tokens in one step, then one token a step for one request)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import httpx
import pytest

from splitserve.protocol.step_record import read_step_log
from tests.conftest import free_port, running_server

PROMPT = list(range(20, 60))  # 40 token IDs: one prefill step within any budget
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def complete(base: str) -> None:
    response = httpx.post(base + "/v1/completions", json=BODY, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == BODY["max_tokens"]


def test_serve_logs_each_step_it_computes(tiny_model, tmp_path):
    log = tmp_path / "steps.jsonl"
    port = free_port()
    with running_server(["serve", tiny_model, "--port", str(port), "--step-log", str(log)], port) as base:
        complete(base)
    records = read_step_log(log)
    assert [r.tokens for r in records] == [len(PROMPT)] + [1] * (BODY["max_tokens"] - 1)
    assert [r.running for r in records] == [1] * (BODY["max_tokens"] - 1) + [0]
    assert {(r.pid, r.role) for r in records} == {(records[0].pid, "both")}
    assert all(r.step_s > 0 for r in records)
    assert all(a.t < b.t and a.thread_cpu_s <= b.thread_cpu_s for a, b in itertools.pairwise(records))
    # the engine thread's wait for a core so far (Linux keeps it per thread): it only grows
    waits = [r.thread_wait_s for r in records]
    assert all(w is not None and w >= 0 for w in waits), waits
    assert waits == sorted(waits)


def test_the_engine_counts_its_threads_wait_for_a_core_in_steps(tiny_model, tmp_path):
    """`engine`'s /metrics: the engine thread's wait for a core within steps, a part of its
    whole wait, which the step log's last record read after the last step. And its stats
    list its recent steps as the step log has them (`sim calibrate` reads a step there)."""
    log = tmp_path / "steps.jsonl"
    port = free_port()
    with running_server(["engine", tiny_model, "--port", str(port), "--step-log", str(log)], port) as base:
        sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        body = {"token_ids": PROMPT, "sampling_params": sampling}
        assert httpx.post(base + "/inference/v1/generate", json=body, timeout=60).status_code == 200
        metrics = httpx.get(base + "/metrics", timeout=10).text
        stats = httpx.get(base + "/inference/v1/stats", timeout=10).json()
        recent = stats["recent_steps"]
    records = read_step_log(log)
    assert [(r.tokens, r.step_s) for r in records] == [(n, round(s, 6)) for n, s in recent]
    assert [n for n, _ in recent] == [len(PROMPT)] + [1] * (sampling["max_tokens"] - 1)
    # the last step decoded the answer's last token, attending the prompt and the rest
    last = {"decodes": 1, "decode_context": len(PROMPT) + sampling["max_tokens"] - 2, "chunks": []}
    assert stats["last_step_shape"] == last
    found = [float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("splitserve_step_thread_wait_seconds_total")]  # fmt: skip
    assert len(found) == 1, metrics
    last = records[-1]
    assert last.thread_wait_s is not None and 0 <= found[0] <= last.thread_wait_s


def test_up_gives_every_engine_the_step_log(tiny_model, tmp_path):
    log = tmp_path / "steps.jsonl"
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--num-blocks", "256", "--step-log", str(log)]
    args += ["--min-prefill-tokens", "2", "--pd-decision", "threshold"]  # the prompt goes to prefill
    with running_server(args, port, timeout=180) as base:
        complete(base)
    records = read_step_log(log)
    prefill = [r.tokens for r in records if r.role == "prefill"]
    decode = [r.tokens for r in records if r.role == "decode"]
    assert prefill == [len(PROMPT)]  # it computes the prompt and samples the first token
    # decode computes the last prompt token itself (docs/pd.md), then one token a step
    assert decode == [1] * BODY["max_tokens"]
    assert len({r.pid for r in records}) == 2


def test_a_step_log_that_cannot_be_opened_stops_serve_with_its_reason(tiny_model, tmp_path):
    missing = tmp_path / "no-such-folder" / "steps.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "serve", tiny_model, "--step-log", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--step-log" in done.stderr and "no-such-folder" in done.stderr


def test_a_line_that_is_not_a_step_record_is_named(tmp_path):
    log = tmp_path / "steps.jsonl"
    whole = {"pid": 1, "role": "both", "t": 1.0, "step_s": 0.1, "tokens": 3, "running": 1}
    whole["thread_cpu_s"] = 0.1
    log.write_text(json.dumps(whole) + "\n")
    # a log written before the wait for a core was recorded still reads
    assert read_step_log(log)[0].thread_wait_s is None
    log.write_text(json.dumps(whole) + '\n{"pid": 1}\n')
    with pytest.raises(ValueError, match=f"{log}:2: not a step record"):
        read_step_log(log)
