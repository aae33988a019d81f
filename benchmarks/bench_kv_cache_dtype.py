"""Decode attention over a float32 KV cache against a 16-bit one (`--kv-cache-dtype`),
float32 queries either way: one sequence (batch 1) at a few context lengths, a model's
shape (default SmolLM2-135M's: 9 query heads, 3 KV heads, head_dim 64, 30 layers), the
time of one decode step's attention over every layer (the paged kernel, ops.py).

    .venv/bin/python benchmarks/bench_kv_cache_dtype.py [--contexts 1024 3000] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from splitserve.model import ops
from splitserve.model.native import load_cpu_ops


def step_seconds(cache_dtype: torch.dtype, args: argparse.Namespace, context: int) -> float:
    """Median over rounds of one step's attention over every layer; each layer its own cache
    (a step reads every layer's KV once, from memory, not from a cache the last layer warmed)."""
    block_size = 16
    blocks = -(-context // block_size)
    layers = [
        torch.randn(2, blocks, block_size, args.kv_heads, args.head_dim).to(cache_dtype)
        for _ in range(args.layers)
    ]
    table = torch.randperm(blocks, dtype=torch.int32)[None]  # scattered blocks, as a long-lived pool's
    lens = torch.tensor([context], dtype=torch.int32)
    q = torch.randn(1, args.heads, args.head_dim)
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for kv_layer in layers:
            ops.paged_decode_attention(out, q, kv_layer, table, lens, scale)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 3000])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"compiled kernels: {load_cpu_ops()}, threads {args.threads}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads x {args.head_dim}")  # fmt: skip
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    ratios = []
    for context in args.contexts:
        # interleaved, twice: a neighbour's load falls on every dtype alike
        runs = {dtype: [] for dtype in dtypes}
        for _ in range(2):
            for dtype in dtypes:
                runs[dtype].append(step_seconds(dtype, args, context))
        best = {dtype: min(times) for dtype, times in runs.items()}
        kv_mb = 2 * context * args.kv_heads * args.head_dim * args.layers / 1e6
        print(f"ctx {context}: " + ", ".join(
            f"{str(d).removeprefix('torch.')} cache {best[d] * 1e3:.3f} ms ({kv_mb * d.itemsize:.1f} MB)"
            for d in dtypes
        ))  # fmt: skip
        ratios.append(best[torch.float32] / best[torch.float16])
    print("float32-cache time / float16-cache time: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
