"""One batch-1 matvec through the GGUF block kernels (csrc/quant_matmul*.cpp), per type
and kernel path: x [1, K] float32 times a [N, K] weight kept in its blocks, the shape of
SmolLM2-135M's down_proj (576 x 1536) by default. Prints the median time of `--calls`
calls, the weight bytes read and the rate, and each type's ratio to Q4_1 (the type the
demo model's projections use) and to bf16 F.linear on the same shape, measured in the
same run. The blocks are random bytes with fp16 scales set: the time does not depend on
the values.

    .venv/bin/python benchmarks/bench_quant_matvec.py [--rows 576 --cols 1536 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from splitserve.model.native import load_cpu_ops
from splitserve.model.quant_linear import BLOCK_BYTES, K_QUANT_TYPES, quant_linear, row_bytes

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# the fp16 scale fields of each K-quant super-block (random bits there could be NaN)
K_HALF_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
PATH_NAMES = {2: "vnni", 1: "avx2", 0: "scalar"}


def weight_blocks(
    qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator
) -> torch.Tensor:
    if qtype not in K_QUANT_TYPES:
        values = rng.standard_normal((rows, cols)).astype(np.float32) / 32
        return torch.from_numpy(quantize(values, qtype))
    blocks = rng.integers(0, 256, size=(rows * cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in K_HALF_OFFSETS[qtype.name]:
        blocks[:, offset : offset + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, row_bytes(qtype, cols)))


def median_us(call: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(max(10, calls // 10)):  # warm caches and the thread pool
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=576, help="N, output features")
    parser.add_argument("--cols", type=int, default=1536, help="K, input features (a multiple of 256)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.cols % 256 or args.rows < 1:
        parser.error("--cols must be a multiple of 256 (the K-quants' super-block) and --rows positive")
    if not load_cpu_ops():
        print("compiled CPU kernels unavailable")
        return 1
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    x = torch.randn(1, args.cols)
    dense = torch.randn(args.rows, args.cols, dtype=torch.bfloat16)
    x16 = x.bfloat16()
    bf16_us = median_us(lambda: F.linear(x16, dense), args.calls)
    best = int(torch.ops.splitserve_cpu.quant_linear_best_isa())
    print(
        f"x [1, {args.cols}] @ W[{args.rows}, {args.cols}]^T, {args.threads} thread(s), "
        f"median of {args.calls}"
    )
    print(f"bf16 F.linear: {bf16_us:.1f} us ({dense.numel() * 2 / bf16_us / 1e3:.2f} GB/s)")
    results: dict[tuple[str, int], float] = {}
    for name in TYPES:
        qtype = GGMLQuantizationType[name]
        blocks = weight_blocks(qtype, args.rows, args.cols, rng)
        for isa in range(best, -1, -1):
            us = median_us(lambda b=blocks, q=qtype, i=isa: quant_linear(x, b, q, None, i), args.calls)
            results[name, isa] = us
            print(
                f"{name} {PATH_NAMES[isa]:>6}: {us:7.1f} us, {blocks.numel() / 1e3:.0f} KB "
                f"({blocks.numel() / us / 1e3:.2f} GB/s)"
            )
    print("ratios on the best path (lower is faster):")
    for name in TYPES:
        us = results[name, best]
        print(f"{name}: {us / results['Q4_1', best]:.2f}x Q4_1, {us / bf16_us:.2f}x bf16 F.linear")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
