"""Calibrate the simulator against splitserve's own engine, then check it on a run it was not
fitted to.

1. This host's peaks: the best of a few large fp32 matmuls (FLOP/s) and copies (bytes/s),
   written as a GPU spec JSON (the roofline needs a ceiling to take fractions of).
2. A tiny Qwen3-shaped model (random weights, float32) built on the fly.
3. Engine steps of known shape: one prompt of N tokens after P cached ones (prefill), and B
   running sequences at context C (decode); `LLMEngine.last_step_time_s` is the step time.
4. `splitserve sim calibrate`'s fit on those samples: efficiency factors and fit error.
5. Hold-out: a batch of requests (several prompts per step, chunked with a token budget)
   through the engine, and through the simulator with the fitted factors. Printed LAST:
   simulated / measured time for that batch (the peer here is the real engine, same run).

    .venv/bin/python benchmarks/bench_sim_calibrate_engine.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.sim import Deployment, InstanceConfig, Roofline, Workload, load_gpu, load_model, simulate
from splitserve.sim.calibrate import Sample, fit, samples_to_json

SPEC = TinyModelSpec(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1536, vocab=8192)
BUDGET = 1024


def host_peaks() -> dict:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best_flops = 0.0
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best_flops = max(best_flops, 4 * 2 * 1024**3 / (time.perf_counter() - t))
    src = torch.randn(64 * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    best_bw = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best_bw = max(best_bw, 2 * src.numel() * 4 / (time.perf_counter() - t))  # read + write
    return {"name": "this-cpu", "peak_flops": best_flops, "mem_bw": best_bw, "mem_bytes": 8e9}


def make_engine(model_dir: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=model_dir, device="cpu"),
            cache=CacheConfig(kv_cache_memory_bytes=256 * 1024 * 1024, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=64),
        )
    )


def prompt(n: int, salt: int) -> list[int]:
    rng = np.random.default_rng(salt)
    return [int(x) for x in rng.integers(10, SPEC.vocab - 10, n)]


def measure(engine: LLMEngine, repeats: int = 4) -> list[Sample]:
    """One sample per shape: the fastest of `repeats` runs (the CPU is shared, and other
    processes only ever add time)."""
    samples: list[Sample] = []
    greedy = dict(temperature=0.0, ignore_eos=True)
    for n, past in ((64, 0), (256, 0), (512, 0), (1024, 0), (1024, 1024)):  # prefill steps
        best = float("inf")
        for rep in range(repeats):
            rid = f"p{n}-{past}-{rep}"
            engine.add_request(
                GenerateRequest(rid, tuple(prompt(n + past, n + rep)), SamplingParams(max_tokens=1, **greedy))
            )
            done = 0  # a prompt longer than the budget is chunked: step k has k * BUDGET cached
            while engine.has_unfinished_requests():
                engine.step()
                if engine.last_step_tokens and done == past:
                    best = min(best, engine.last_step_time_s)
                done += engine.last_step_tokens
                engine.last_step_tokens = 0
        samples.append(Sample("prefill", n, past, best))
    for batch, ctx in ((1, 256), (4, 256), (8, 512), (16, 256), (32, 128)):  # decode at a known context
        for i in range(batch):
            engine.add_request(
                GenerateRequest(
                    f"d{batch}-{i}",
                    tuple(prompt(ctx, 1000 + i)),
                    SamplingParams(max_tokens=4 + repeats, **greedy),
                )
            )
        best, steps = float("inf"), 0
        while engine.has_unfinished_requests():
            engine.step()
            if engine.last_step_tokens == batch:  # every sequence decoding, no prefill in the step
                steps += 1
                if steps > 1:  # the first decode step warms up the new batch shape
                    best = min(best, engine.last_step_time_s)
        samples.append(Sample("decode", batch, ctx + 3, best))
    return samples


def holdout(engine: LLMEngine, n: int = 24, prompt_len: int = 300, output: int = 24) -> float:
    for i in range(n):
        engine.add_request(
            GenerateRequest(
                f"h{i}",
                tuple(prompt(prompt_len, 5000 + i)),
                SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True),
            ),
        )
    total = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        total += engine.last_step_time_s
        engine.last_step_time_s = 0.0
    return total


if __name__ == "__main__":
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model", SPEC))
        gpu_path = Path(tmp) / "cpu.json"
        peaks = host_peaks()
        gpu_path.write_text(json.dumps(peaks))
        engine = make_engine(model_dir)
        measure(engine, repeats=1)  # warm-up pass
        samples = measure(engine)
        (Path(tmp) / "steps.json").write_text(json.dumps(samples_to_json(samples)))
        model, gpu = load_model(model_dir), load_gpu(str(gpu_path))
        res = fit(Roofline(model, gpu), samples, attention=True, per_seq=True)
        print(f"host peaks: {peaks['peak_flops'] / 1e9:.1f} GFLOP/s fp32, {peaks['mem_bw'] / 1e9:.1f} GB/s")
        print(
            f"{len(samples)} engine steps ({res.compute_bound} compute-bound) on a "
            f"{model.layers}-layer {model.hidden}-wide model ({model.total_params / 1e6:.1f}M params, fp32)"
        )
        print(
            f"fitted: compute {res.eff.compute:.3f}, attention {res.eff.attention or res.eff.compute:.3f}, "
            f"per sequence {res.eff.per_seq_overhead_s * 1e3:.2f} ms, bandwidth {res.eff.bandwidth:.3f}, "
            f"overhead {res.eff.overhead_s * 1e3:.2f} ms/step; fit error rms {res.rms_rel_error:.1%}, "
            f"max {res.max_rel_error:.1%}"
        )
        measured = holdout(engine)
        dep = Deployment(
            model,
            gpu,
            replicas=1,
            eff=res.eff,
            sched=InstanceConfig(SchedulerConfig(max_num_batched_tokens=BUDGET)),
        )
        wl = Workload.open_loop(np.zeros(24), np.full(24, 300), np.full(24, 24))
        simulated = float(np.max(simulate(dep, wl).e2e))
        print(
            f"hold-out batch (24 x 300-token prompts, 24 tokens each): engine {measured:.3f} s of steps, "
            f"simulator {simulated:.3f} s"
        )
        print(f"simulated / measured: {simulated / measured:.2f}")
