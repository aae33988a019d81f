"""Attention-FFN disaggregation, first cut: decode throughput of a MoE model collocated
against the same model with its experts on an FFN daemon (`engine --role ffn`, a
subprocess on this host, tcp), the AFD bytes per decode step each way, and whether the
greedy tokens are the same (they must be).

The daemon and the attention engine share this machine's cores, and nothing overlaps a
layer's transfer with compute yet: the figure is the cost of the round trips, not what
AFD gives on separate chips (docs/afd.md).

Run: .venv/bin/python benchmarks/bench_afd.py [--model DIR] [--dtype bfloat16] [--streams 8 --tokens 64]
(no --model: a tiny Qwen3-MoE, 4 layers, 8 experts, top-2, written to a temporary folder)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

from splitserve.config import AfdConfig
from splitserve.engine.llm import LLM, engine_config_from_kwargs
from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from splitserve.runtime.ports import pick_free_port


def decode_run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """The greedy tokens and the seconds of a run after a short warm-up."""
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [r.token_ids for r in results], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(
        write_tiny_model(tempfile.mkdtemp(), TinyModelSpec(arch="qwen3_moe", layers=4, dtype=args.dtype))
    )
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(args.streams)]
    engine = {"num_blocks": 256, "dtype": args.dtype}
    expected, collocated_s = decode_run(LLM(model, **engine), prompts, args.tokens)

    port = pick_free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_ENV}  # an open loopback pair
    command = [sys.executable, "-m", "splitserve.cli", "engine", model, "--role", "ffn", "--port", str(port)]
    daemon = subprocess.Popen(
        [*command, "--dtype", args.dtype],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        os.environ.pop(INTERNAL_TOKEN_ENV, None)
        config = engine_config_from_kwargs(model, **engine)
        llm = LLM(config=dataclasses.replace(config, afd=AfdConfig("127.0.0.1", port, timeout_s=120.0)))
        ffn = llm.engine.runner.ffn
        assert ffn is not None
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        before = (
            ffn.bytes_sent,
            ffn.bytes_received,
            ffn.round_trip_s,
            ffn.remote_compute_s,
            llm.engine.num_steps,
        )
        got, afd_s = decode_run(llm, prompts, args.tokens)
        after = (
            ffn.bytes_sent,
            ffn.bytes_received,
            ffn.round_trip_s,
            ffn.remote_compute_s,
            llm.engine.num_steps,
        )
        sent, received, round_trip_s, remote_s, steps = (b - a for a, b in zip(before, after, strict=True))
    finally:
        os.killpg(daemon.pid, signal.SIGINT)
        daemon.wait()
    generated = args.streams * args.tokens
    print(f"{model}: {args.streams} streams x {args.tokens} tokens, {args.dtype}")
    collocated_ms, afd_ms = collocated_s / args.tokens * 1e3, afd_s / args.tokens * 1e3
    print(f"  collocated  {generated / collocated_s:8.0f} tok/s  {collocated_ms:6.2f} ms/step")
    print(f"  AFD (tcp)   {generated / afd_s:8.0f} tok/s  {afd_ms:6.2f} ms/step")
    print(
        f"  AFD bytes per step: sent {sent / steps:.0f}, received {received / steps:.0f} (prefills included)"
    )
    exposed_ms = (round_trip_s - remote_s) / steps * 1e3
    print(
        f"  AFD per step: round trips {round_trip_s / steps * 1e3:.2f} ms, of which the daemon's compute "
        f"{remote_s / steps * 1e3:.2f} ms; exposed communication {exposed_ms:.2f} ms "
        f"({exposed_ms / afd_ms:.0%} of the step)"
    )
    print(f"  same greedy tokens: {got == expected}")


if __name__ == "__main__":
    main()
