"""The bf16 GEMV kernel (csrc/gemv_bf16.cpp) against oneDNN on one matmul shape: x [M, K]
bf16 times a [N, K] bf16 weight, SmolLM2-135M's tied lm_head (576 -> 49152) by default.

Per M: the median (and 10th percentile) time of `--calls` calls of the GEMV on the plain
weight, oneDNN's `_linear_pointwise` on the weight prepacked for batch 1 (what linear.py
ran before), and F.linear on the plain weight (oneDNN reordering it on every call), with
the weight bytes read per second. Repeated calls on one weight would find it in the last-level cache and
overstate the bandwidth: each call uses the next of several copies of the weight, together
`--rotate-mb` (default 1024 MB, above any L3), so every call reads its weight from DRAM.

    .venv/bin/python benchmarks/bench_gemv_bf16.py [--n 49152 --k 576 --rows 1 2 4 8 16 64]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitserve.model.native import load_cpu_ops


def median_and_p10_us(call: Callable[[int], torch.Tensor], copies: int, calls: int) -> tuple[float, float]:
    for i in range(copies):  # touch every copy once (page faults, the thread pool)
        call(i)
    times = []
    for i in itertools.islice(itertools.cycle(range(copies)), calls):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    # the 10th percentile too: on shared cores the median can be a neighbour's time slice
    return statistics.median(times) * 1e6, statistics.quantiles(times, n=10)[0] * 1e6


def contenders(
    x: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor]
) -> dict[str, Callable[[int], torch.Tensor]]:
    """Each way to multiply x by weight copy i."""
    out = torch.empty(x.shape[0], weights[0].shape[0], dtype=torch.bfloat16)

    def kernel(i: int) -> torch.Tensor:
        torch.ops.splitserve_cpu.gemv_bf16(out, x, weights[i], None)
        return out

    return {
        "gemv_bf16": kernel,
        "oneDNN packed": lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], ""),
        "F.linear": lambda i: F.linear(x, weights[i]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=49152, help="N, output features")
    parser.add_argument("--k", type=int, default=576, help="K, input features")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64], help="M values")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rotate-mb", type=float, default=1024.0, help="total size of the weight copies")
    args = parser.parse_args()
    if not load_cpu_ops() or not torch.ops.splitserve_cpu.gemv_bf16_supported():
        print("the bf16 GEMV kernel is unavailable (no compiled kernels, or no AVX512-BF16)")
        return 1
    weight_bytes = args.n * args.k * 2
    copies = max(2, int(args.rotate_mb * 1e6 / weight_bytes + 0.5))
    weights = [torch.randn(args.n, args.k, dtype=torch.bfloat16) / 24 for _ in range(copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    print(
        f"W [{args.n}, {args.k}] bf16 ({weight_bytes / 1e6:.1f} MB), {copies} copies rotated "
        f"({copies * weight_bytes / 1e6:.0f} MB), {torch.get_num_threads()} threads, "
        f"median (10th percentile) of {args.calls}"
    )
    for rows in args.rows:
        x = torch.randn(rows, args.k, dtype=torch.bfloat16)
        figures = []
        for name, call in contenders(x, weights, packed).items():
            median, p10 = median_and_p10_us(call, copies, args.calls)
            figures.append(
                f"{name} {median:6.0f} us {weight_bytes / median / 1e3:4.1f} GB/s (p10 {p10:6.0f})"
            )
        print(f"M {rows:4d}: " + " | ".join(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
