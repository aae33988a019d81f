"""A linear layer whose weight stays in a GGUF block format (Q8_0, Q4_0, Q4_1, and the
K-quants Q4_K, Q5_K, Q6_K).

The weight is the file's own bytes, one row of blocks per output feature: 32-weight
blocks (an fp16 scale, Q4_1 also an fp16 minimum, then 32 int8 or 32 packed 4-bit values)
or 256-weight K-quant super-blocks (fp16 scales and 6- or 8-bit sub-block scales, then
4, 5 or 6 bits a weight), so a decode step reads 8.5 (Q8_0), 4.5 (Q4_0, Q4_K), 5 (Q4_1),
5.5 (Q5_K) or 6.6 (Q6_K) bits per weight instead of 16 or 32. On the CPU,
csrc/quant_matmul.cpp (and csrc/quant_matmul_k.cpp for the K-quants) multiplies it as
llama.cpp does: the activations are quantized to int8 per block of 32 (per 256 for the
K-quants) and each block's dot product is exact integer arithmetic, scaled by the two
blocks' scales. Elsewhere (CUDA, no compiled kernels) the weight is dequantized once, on
first use, and F.linear runs: the same weight, without the activation rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from splitserve.model.native import load_cpu_ops, use_cpu_ops

BLOCK_BYTES = {
    GGMLQuantizationType.Q8_0: 34,
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q4_K: 144,
    GGMLQuantizationType.Q5_K: 176,
    GGMLQuantizationType.Q6_K: 210,
}
K_QUANT_TYPES = frozenset((GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K))
# weights per block: the K-quants' super-blocks hold 256, the others' blocks 32
BLOCK_SIZE = {qtype: 256 if qtype in K_QUANT_TYPES else 32 for qtype in BLOCK_BYTES}
QUANTIZED_TYPES = frozenset(BLOCK_BYTES)
BEST_ISA = -1  # quant_linear's `isa`: the best path compiled in (2 VNNI, 1 AVX2, 0 scalar)


class RowTypes(NamedTuple):
    """A fused Linear whose parts a file stores in different types (a Q4_K_M file's Q4_K
    attn_q and attn_k beside a Q6_K attn_v): each part's type and rows, in row order."""

    parts: tuple[tuple[GGMLQuantizationType, int], ...]


# what a Linear stays quantized as: one type for all its rows, or one per fused part
QuantLayout = GGMLQuantizationType | RowTypes


# x dtypes the compiled kernels take
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def type_names() -> str:
    return ", ".join(sorted(qtype.name for qtype in QUANTIZED_TYPES))


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    return in_features // BLOCK_SIZE[qtype] * BLOCK_BYTES[qtype]


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D weight as a GGUF file stores it: `blocks` is uint8 [rows, row_bytes]."""

    qtype: GGMLQuantizationType
    blocks: torch.Tensor
    shape: tuple[int, int]  # (out_features, in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, in_features], as gguf.quants.dequantize computes it."""
        return dequantize_blocks(self.blocks, self.qtype, self.shape[1])


def dequantize_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    values = dequantize(blocks.numpy(), qtype).reshape(blocks.shape[0], in_features)
    return torch.from_numpy(np.array(values, dtype=np.float32, order="C"))


def quant_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: GGMLQuantizationType,
    bias: torch.Tensor | None = None,
    isa: int = BEST_ISA,
) -> torch.Tensor:
    """x [..., K] (float32 or bf16) times the quantized weight's transpose, in x's dtype,
    through the compiled kernel (`isa` forces a lower path: the tests run each one)."""
    if not load_cpu_ops():
        raise RuntimeError("the compiled CPU kernels are unavailable")
    # at batch 1 a matvec takes 20-200 us: a 2-D contiguous x (the decoder's) goes to the
    # kernel without reshapes or views
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    out = flat.new_empty(flat.shape[0], blocks.shape[0])
    kernel_for(qtype)(out, flat, blocks, qtype.value, bias, isa)
    return out if flat is x else out.view(*x.shape[:-1], blocks.shape[0])


@functools.lru_cache(maxsize=len(BLOCK_BYTES))
def kernel_for(qtype: GGMLQuantizationType) -> Callable[..., None]:
    """The compiled op that multiplies this type (looked up once: a decode step calls it
    ~120 times, and each torch.ops lookup costs about a microsecond)."""
    ops = torch.ops.splitserve_cpu
    return ops.quant_linear_k if qtype in K_QUANT_TYPES else ops.quant_linear


class QuantLinear(nn.Module):
    """Linear(in_features, out_features) over a QuantizedTensor weight; its rows are
    filled part by part (the decoder fuses q/k/v and gate/up into one matmul)."""

    def __init__(
        self, in_features: int, out_features: int, qtype: GGMLQuantizationType, bias: bool = False
    ) -> None:
        super().__init__()
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"{qtype.name} weights cannot stay quantized; types: {type_names()}")
        if in_features % BLOCK_SIZE[qtype]:
            raise ValueError(f"a {qtype.name} weight needs in_features a multiple of {BLOCK_SIZE[qtype]}")
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.register_buffer(
            "blocks", torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8)
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.rows_loaded = 0
        self.dequantized: torch.Tensor | None = None  # the fallback's weight, made on first use
        self.kernel_bias: torch.Tensor | None = None  # the bias as the kernel takes it, made on first use

    def load_rows(self, start: int, weight: QuantizedTensor) -> None:
        if weight.qtype != self.qtype or weight.shape[1] != self.in_features:
            raise ValueError(
                f"a {weight.qtype.name} weight of shape {weight.shape} does not fit rows of "
                f"{self.qtype.name} [{self.out_features}, {self.in_features}]"
            )
        self.blocks[start : start + weight.shape[0]].copy_(weight.blocks)
        self.rows_loaded += weight.shape[0]

    def bias_for_kernel(self) -> torch.Tensor | None:
        """The bias as the compiled kernel takes it: float32, contiguous (made once)."""
        if self.bias is not None and self.kernel_bias is None:
            self.kernel_bias = self.bias.detach().float().contiguous()
        return self.kernel_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in KERNEL_DTYPES and use_cpu_ops(x):
            return quant_linear(x, self.blocks, self.qtype, self.bias_for_kernel())
        if self.dequantized is None or self.dequantized.dtype != x.dtype:
            weight = dequantize_blocks(self.blocks.cpu(), self.qtype, self.in_features)
            self.dequantized = weight.to(device=x.device, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}"


class MixedQuantLinear(nn.Module):
    """A fused Linear whose row ranges are QuantLinears of different types: one kernel
    call per part, the outputs side by side (the bias, if any, is the whole Linear's)."""

    def __init__(self, in_features: int, row_types: RowTypes, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in row_types.parts)
        self.parts = nn.ModuleList(QuantLinear(in_features, rows, qtype) for qtype, rows in row_types.parts)
        self.starts = []  # each part's first row
        start = 0
        for _, rows in row_types.parts:
            self.starts.append(start)
            start += rows
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    @property
    def rows_loaded(self) -> int:
        return sum(part.rows_loaded for part in self.parts)

    def load_rows(self, start: int, weight: QuantizedTensor) -> None:
        """`weight` fills the part that begins at row `start`, whole."""
        part = self.parts[self.starts.index(start)] if start in self.starts else None
        if part is None or weight.shape[0] != part.out_features:
            raise ValueError(f"{weight.shape[0]} rows at row {start} are no part of [{self.extra_repr()}]")
        part.load_rows(0, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        types = ", ".join(f"{part.qtype.name} x{part.out_features}" for part in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{types}]"


def replace_with_quant_linears(model: nn.Module, quantized: Mapping[str, QuantLayout]) -> None:
    """Swap each named Linear of `model` (`layers.0.self_attn.qkv_proj`, `lm_head`) for a
    QuantLinear of the same shape holding that type's blocks (a MixedQuantLinear where
    its parts' types differ)."""
    for name, layout in quantized.items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name!r} is not a Linear layer")
        parent_name, _, attr = name.rpartition(".")
        bias = old.bias is not None
        if isinstance(layout, RowTypes):
            if sum(rows for _, rows in layout.parts) != old.out_features:
                raise ValueError(f"the parts of {name!r} do not add up to its {old.out_features} rows")
            replacement: nn.Module = MixedQuantLinear(old.in_features, layout, bias=bias)
        else:
            replacement = QuantLinear(old.in_features, old.out_features, layout, bias=bias)
        setattr(model.get_submodule(parent_name), attr, replacement)
