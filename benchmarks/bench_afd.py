"""Attention-FFN disaggregation: decode throughput and ITL of a MoE model collocated against
the same model with its experts on an FFN daemon (`engine --role ffn`, a subprocess on
this host, tcp), its decode steps as one batch (`--afd-microbatches 1`) and as two
overlapped micro-batches (2); per step, the AFD bytes each way, the time the step was held
up by the daemon, the daemon's compute and the exposed communication (held up less
compute); and whether the greedy tokens are the same (they must be).

The daemon and the attention engine share this machine's cores: overlap hides a layer's
round trip behind the other micro-batch's attention only as far as both processes find a
core at once (docs/afd.md). The AFD runs alternate (1, 2, 1, 2, ...) and each figure is
the median of `--repeats`, so a busy spell of the shared machine hits both.

Run: .venv/bin/python benchmarks/bench_afd.py [--model DIR] [--dtype bfloat16] [--hidden 64]
     [--streams 8 --tokens 64 --repeats 3] [--threads N]
(no --model: a tiny Qwen3-MoE, 4 layers, 8 experts, top-2, written to a temporary folder)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from splitserve.afd.ffn_client import AfdTotals
from splitserve.config import AfdConfig
from splitserve.engine.llm import LLM, engine_config_from_kwargs
from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from splitserve.runtime.ports import pick_free_port


@dataclass(frozen=True)
class AfdRun:
    seconds: float
    steps: int
    sent: int
    received: int
    blocked_s: float
    remote_s: float
    tokens: list[list[int]]


def decode_run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """The greedy tokens and the seconds of a run after a short warm-up."""
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [r.token_ids for r in results], time.perf_counter() - started


def afd_run(llm: LLM, prompts: list[list[int]], tokens: int) -> AfdRun:
    ffn = llm.engine.runner.ffn
    assert ffn is not None
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    before, steps_before = ffn.totals(), llm.engine.num_steps
    started = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - started
    after: AfdTotals = ffn.totals()
    got = [r.token_ids for r in results]
    return AfdRun(
        seconds,
        llm.engine.num_steps - steps_before,
        after.bytes_sent - before.bytes_sent,
        after.bytes_received - before.bytes_received,
        after.blocked_s - before.blocked_s,
        after.remote_compute_s - before.remote_compute_s,
        got,
    )


def median_run(runs: list[AfdRun]) -> AfdRun:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=64, help="the tiny model's hidden size (no --model)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of each process, the daemon's too (0: torch's default)",
    )
    parser.add_argument(
        "--transport",
        default="tcp",
        choices=["shm", "tcp"],
        help="how the layers' tensors reach the daemon (docs/afd.md): tcp frames (the "
        "figures' default) or a shared-memory segment",
    )
    args = parser.parse_args()
    if args.threads:  # before any engine: the runner takes torch's thread count as its own
        torch.set_num_threads(args.threads)
    spec = TinyModelSpec(arch="qwen3_moe", layers=4, hidden=args.hidden, dtype=args.dtype)
    model = args.model or str(write_tiny_model(tempfile.mkdtemp(), spec))
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(args.streams)]
    engine = {"num_blocks": 256, "dtype": args.dtype}
    collocated = LLM(model, **engine)
    colloc_runs = [decode_run(collocated, prompts, args.tokens) for _ in range(args.repeats)]
    expected = colloc_runs[0][0]
    collocated_s = statistics.median(s for _, s in colloc_runs)
    collocated.engine.shutdown()

    port = pick_free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_ENV}  # an open loopback pair
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    command = [sys.executable, "-m", "splitserve.cli", "engine", model, "--role", "ffn", "--port", str(port)]
    daemon = subprocess.Popen(
        [*command, "--dtype", args.dtype],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs: dict[int, list[AfdRun]] = {1: [], 2: []}
    try:
        os.environ.pop(INTERNAL_TOKEN_ENV, None)
        config = engine_config_from_kwargs(model, **engine)
        afd = {m: AfdConfig("127.0.0.1", port, 120.0, m, args.transport) for m in runs}
        llms = {m: LLM(config=dataclasses.replace(config, afd=afd[m])) for m in runs}
        for _ in range(args.repeats):
            for microbatches, llm in llms.items():
                runs[microbatches].append(afd_run(llm, prompts, args.tokens))
    finally:
        os.killpg(daemon.pid, signal.SIGINT)
        daemon.wait()
    generated = args.streams * args.tokens
    threads = f"{args.threads} torch threads each" if args.threads else "torch's default threads"
    print(
        f"{model}: hidden {args.hidden}, {args.streams} streams x {args.tokens} tokens, {args.dtype}, "
        f"{threads}, median of {args.repeats}, AFD over {args.transport}"
    )
    collocated_ms = collocated_s / args.tokens * 1e3
    print(f"  collocated           {generated / collocated_s:8.0f} tok/s  ITL {collocated_ms:6.2f} ms")
    for microbatches, afd_runs in runs.items():
        run = median_run(afd_runs)
        itl_ms, per_step = run.seconds / args.tokens * 1e3, 1e3 / run.steps
        exposed_ms = max(0.0, run.blocked_s - run.remote_s) * per_step
        print(
            f"  AFD, {microbatches} micro-batch{'es' if microbatches > 1 else '  '} "
            f"{generated / run.seconds:8.0f} tok/s  ITL {itl_ms:6.2f} ms  "
            f"({collocated_s / run.seconds:.2f}x collocated)"
        )
        print(
            f"      per step: sent {run.sent / run.steps:.0f} B, received {run.received / run.steps:.0f} B; "
            f"held up {run.blocked_s * per_step:.2f} ms, daemon compute {run.remote_s * per_step:.2f} ms, "
            f"exposed communication {exposed_ms:.2f} ms ({exposed_ms / itl_ms:.0%} of the ITL)"
        )
    same = all(run.tokens == expected for afd_runs in runs.values() for run in afd_runs)
    print(f"  same greedy tokens (every run, 1 and 2 micro-batches): {same}")
    one, two = (median_run(runs[m]).seconds for m in (1, 2))
    print(f"  2 micro-batches vs 1: ITL x{two / one:.2f}")


if __name__ == "__main__":
    main()
