"""`sim calibrate --engine URL` against a synthetic engine: an HTTP server speaking the
engine API whose steps take exactly what a roofline at known factors says (virtual time,
computed by the simulator; nothing sleeps). The fit must recover the factors."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from splitserve.cli import main
from splitserve.config import SchedulerConfig
from splitserve.sim import Deployment, Efficiency, InstanceConfig, Workload, load_gpu, load_model, simulate

TRUTH = Efficiency(
    compute=0.5, bandwidth=0.7, overhead_s=0.003, per_seq_overhead_s=0.0002, small_chunk_tokens=96
)
QUIET_S = 0.6  # requests keep joining a batch until none arrived for this long


class SyntheticEngine:
    def __init__(self, eff: Efficiency) -> None:
        self.dep = Deployment(
            load_model("Qwen2.5-7B"),
            load_gpu("L40S"),
            replicas=1,
            eff=eff,
            sched=InstanceConfig(SchedulerConfig(max_num_batched_tokens=65536)),
        )
        self.step_sum = self.step_count = self.step_tokens = 0.0
        self.pending: list[dict] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._batches, daemon=True).start()

    def submit(self, prompt: int, max_tokens: int) -> dict:
        job = {"prompt": prompt, "max_tokens": max_tokens, "done": threading.Event()}
        with self.cond:
            self.pending.append(job)
            self.cond.notify()
        job["done"].wait()
        return job["result"]

    def _batches(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending)
            seen = 0
            while seen != len(self.pending):  # the probe sends a decode batch from many threads
                seen = len(self.pending)
                time.sleep(QUIET_S)
            with self.cond:
                batch, self.pending = self.pending, []
            n = len(batch)
            prompts = np.array([j["prompt"] for j in batch])
            outputs = np.array([j["max_tokens"] for j in batch])
            r = simulate(self.dep, Workload.open_loop(np.zeros(n), prompts, outputs))
            steps = round(outputs.sum() / r.mean_batch[0])
            self.step_sum += float(r.e2e.max())  # every request arrived at 0: the steps are back to back
            self.step_count += steps
            self.step_tokens += float(prompts.sum() + outputs.sum() - n)
            for i, job in enumerate(batch):
                itl = float(r.tpot[i]) * 1e3 if outputs[i] > 1 else None
                job["result"] = {
                    "ttft_ms": float(r.ttft[i]) * 1e3,
                    "mean_itl_ms": itl,
                    "tokens": int(outputs[i]),
                }
                job["done"].set()

    def metrics_text(self) -> str:
        return (
            f"splitserve_step_time_seconds_count {self.step_count}\n"
            f"splitserve_step_time_seconds_sum {self.step_sum}\n"
            f"splitserve_step_tokens_total {self.step_tokens}\n"
        )


@pytest.fixture(scope="module")
def engine_url():
    engine = SyntheticEngine(TRUTH)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b'{"status": "ok"}')
            elif self.path == "/metrics":
                self._send(200, engine.metrics_text().encode(), "text/plain")
            elif self.path == "/inference/v1/stats":  # calibrate keys the profile by the threads
                self._send(200, b'{"num_threads": 1}')
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            res = engine.submit(len(body["token_ids"]), body["sampling_params"]["max_tokens"])
            out = {
                "request_id": "x",
                "choices": [{"index": 0, "token_ids": [7] * res["tokens"], "finish_reason": "length"}],
                "metrics": {"time_to_first_token_ms": res["ttft_ms"], "mean_itl_ms": res["mean_itl_ms"]},
            }
            self._send(200, json.dumps(out).encode())

    class Server(ThreadingHTTPServer):
        # the probes open up to 16 connections at once: http.server's listen backlog of 5
        # overflowed on a loaded machine and reset one (uvicorn's is 2048)
        request_queue_size = 128

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_calibrate_recovers_known_factors_from_a_synthetic_engine(engine_url, capsys, tmp_path):
    saved = tmp_path / "steps.json"
    argv = ["sim", "calibrate", "--engine", engine_url, "--model", "Qwen2.5-7B", "--gpu", "L40S"]
    argv += [
        "--fit-per-seq",
        "--fit-small-chunk",
        "--repeats",
        "1",
        "--probe-prefill",
        "32,128,512,1024,2048",
    ]
    # long decode contexts, so that KV reads (bandwidth) and the fixed costs can be told apart
    argv += ["--probe-batches", "1,16", "--probe-contexts", "256,4096", "--save", str(saved), "--json"]
    assert main(argv) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["compute"] == pytest.approx(TRUTH.compute, rel=0.02)
    assert fit["bandwidth"] == pytest.approx(TRUTH.bandwidth, rel=0.02)
    assert fit["overhead_s"] == pytest.approx(TRUTH.overhead_s, rel=0.02)
    assert fit["per_seq_overhead_s"] == pytest.approx(TRUTH.per_seq_overhead_s, rel=0.02)
    assert fit["small_chunk_tokens"] == pytest.approx(TRUTH.small_chunk_tokens, rel=0.02)
    assert fit["rms_rel_error"] < 0.002
    samples = json.loads(saved.read_text())["samples"]
    assert [s["kind"] for s in samples] == ["prefill"] * 5 + ["decode"] * 4
    assert samples[-1] == {
        "kind": "decode",
        "batch_size": 16,
        "context_len": 4112,
        "step_time_s": pytest.approx(samples[-1]["step_time_s"]),
    }


def test_calibrate_engine_unreachable(capsys):
    assert main(["sim", "calibrate", "--engine", "http://127.0.0.1:9", "--repeats", "1"]) == 2
    assert "cannot reach the engine" in capsys.readouterr().err
