"""nn.Linear whose bf16/fp16 weight is prepared for the CPU once, after loading.

F.linear reorders a bf16/fp16 weight into oneDNN's blocked layout on every call; at
decode batch sizes that costs as much as the matmul (measured here: 30 layers of the
SmolLM2-135M shape, batch 1, ~1.8x faster prepacked). So the weight is prepacked for
oneDNN once, as inductor's weight freezing does: the same results as F.linear bit for bit
without bias; with a bias, some ISAs round before adding it, one bf16 step apart at most
(tests/model/test_ops.py).

bf16 on a CPU with AVX512-BF16 (and the compiled kernels) also keeps the plain row-major
weight: an input of at most GEMV_MAX_ROWS rows (a decode step of up to 3 sequences) runs
csrc/gemv_bf16.cpp on it, which streams the weight at ~90% of the memory bandwidth where
oneDNN reaches ~70% at batch 1. Larger inputs run oneDNN on the packed copy: without it
(F.linear on the plain weight) a matmul of 4 to 64 rows (decode batches, prefill chunks)
ran 1.7-1.8x slower (bench_gemv_bf16.py, gate_up's shape), so both are kept (the plain weight
costs its size again; a tied lm_head's plain weight is the embedding's own). The GEMV
sums in float32 and rounds once, as F.linear: within one bf16 step of it. float32 and
CUDA keep F.linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.native import load_cpu_ops

# rows of x up to which the GEMV kernel runs. Measured (bench_gemv_bf16.py, 2 cores, rough;
# us, GEMV vs oneDNN's packed path): M 1: gate_up 3072 x 576 136 vs 165, down 576 x 1536
# 64 vs 100, lm_head 49152 x 576 2,169 vs 2,315; M 3: gate_up 164 vs 165, down 71 vs 99,
# o 35 vs 50, lm_head ~2,660 vs ~2,360 (10th percentiles, under load): ~1.4 ms less a
# step over 30 layers and the head; M 4: gate_up 183 vs 165, lm_head 3,170 vs 2,286, more
# in total. VDPBF16PS runs ~0.5 per cycle here, so each added row costs compute that
# oneDNN's AMX path does not (the lm_head alone is already even at 2 rows).
GEMV_MAX_ROWS = 3


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if weight.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


@functools.lru_cache(maxsize=1)
def gemv_kernel_available() -> bool:
    """Whether the bf16 GEMV kernel is compiled in (AVX512-BF16 CPUs); fixed per process."""
    return load_cpu_ops() and bool(torch.ops.splitserve_cpu.gemv_bf16_supported())


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None
    gemv_max_rows: int = 0  # inputs of at most this many rows run the GEMV kernel (0: never)

    def prepack(self, gemv: bool = True) -> None:
        """Pack the weight for oneDNN; keep the plain weight too where the GEMV kernel
        runs (`gemv=False` forces the oneDNN-only path, as on CPUs without AVX512-BF16),
        else release it. A weight shared with another module (a tied lm_head) is copied
        for oneDNN, not released; the GEMV reads it in place."""
        weight = self.weight
        bias_ok = self.bias is None or self.bias.dtype == torch.bfloat16
        if (
            gemv
            and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and weight.is_contiguous()
            and bias_ok
            and gemv_kernel_available()
        ):
            self.gemv_max_rows = GEMV_MAX_ROWS
        if not can_prepack(weight):
            return
        # batch hint 1: the layout chosen for decode; larger batches run as fast as F.linear
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        if not self.gemv_max_rows:
            self.weight = None  # type: ignore[assignment]  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_max_rows and x.dtype == torch.bfloat16 and x.numel() <= self.gemv_max_rows * x.shape[-1]:
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            out = torch.empty(flat.shape[0], self.out_features, dtype=torch.bfloat16)
            torch.ops.splitserve_cpu.gemv_bf16(out, flat, self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
