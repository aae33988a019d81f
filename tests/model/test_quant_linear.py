"""The GGUF block-format matmul (csrc/quant_matmul.cpp) against float64 arithmetic on the
dequantized weight, on every kernel path compiled in (VNNI, AVX2, scalar).

The tolerance is what the int8 activation quantization allows: a block of 32 values of x
is rounded to multiples of d = amax/127, so each value moves by at most d/2 and an output
moves by at most sum over blocks of d_b/2 * sum_i |w_i|; float32 accumulation of the
block products adds ~1e-6 of sum |w||x|, a bf16 output one rounding step (2^-8 relative).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from splitserve.model.native import load_cpu_ops
from splitserve.model.quant_linear import (
    K_QUANT_TYPES,
    QUANTIZED_TYPES,
    QuantizedTensor,
    QuantLinear,
    quant_linear,
)

needs_kernels = pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
# the 32-weight block types; tests/model/test_quant_k.py tests the K-quants' super-blocks
TYPES = sorted(QUANTIZED_TYPES - K_QUANT_TYPES, key=lambda t: t.name)


def quantized_weight(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> QuantizedTensor:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return QuantizedTensor(qtype, torch.from_numpy(quantize(values, qtype)), (rows, cols))


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """[M, N]: the most int8 rounding of x per block (32; 256 for the K-quants) can move
    each output (float64)."""
    blocks = x.double().reshape(x.shape[0], -1, block)
    half_step = blocks.abs().amax(dim=-1) / 127 / 2  # [M, blocks]
    weight_mass = weight.double().abs().reshape(weight.shape[0], -1, block).sum(dim=-1)  # [N, blocks]
    return half_step @ weight_mass.T


def kernel_paths() -> list[int]:
    return list(range(int(torch.ops.splitserve_cpu.quant_linear_best_isa()) + 1)) if load_cpu_ops() else []


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "cols", "rows"),
    # rows: whole 4-row groups, groups and a tail of 1-3, a tail alone; K one block to 48
    [(1, 96, 37), (1, 576, 1), (1, 32, 3), (1, 1536, 6), (2, 64, 9), (5, 160, 67), (40, 64, 33)],
)
def test_quant_linear_within_the_activation_rounding_of_float64(qtype, dtype, tokens, cols, rows):
    weight = quantized_weight(rows, cols, qtype, seed=tokens + cols)
    dequantized = weight.dequantize()
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    reference = x.double() @ dequantized.double().T + bias.double()
    mass = x.double().abs() @ dequantized.double().abs().T
    bound = activation_rounding_bound(x, dequantized) + 1e-5 * mass
    if dtype == torch.bfloat16:
        bound += reference.abs() * 2**-8
    results = []
    for isa in kernel_paths():
        out = quant_linear(x, weight.blocks, qtype, bias, isa)
        assert out.dtype == dtype and out.shape == (tokens, rows)
        error = (out.double() - reference).abs()
        assert (error <= bound).all(), f"path {isa}: worst error/bound {(error / bound).max():.3f}"
        results.append(out.double())
    # the paths sum the same exact block products: float32 ordering apart, one result
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-4 * float(mass.max()) / cols, rtol=1e-2)


@needs_kernels
def test_quant_linear_is_not_the_dequantized_matmul():
    """The activations really are rounded to int8: the error is nonzero and of the bound's order."""
    weight = quantized_weight(64, 256, GGMLQuantizationType.Q4_1, seed=3)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    reference = x.double() @ weight.dequantize().double().T
    error = (quant_linear(x, weight.blocks, weight.qtype).double() - reference).abs()
    bound = activation_rounding_bound(x, weight.dequantize())
    assert 0.01 < float((error / bound).max()) <= 1.0


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_each_output_row_is_the_same_alone_as_in_a_group_of_rows(qtype, dtype, tokens):
    """The SIMD paths multiply 4 weight rows at a time (and a tail of 1-3 alone); each
    row keeps its own chain in block order, so its result is bit for bit the one it has
    multiplied alone: the row-group split (which depends on N and on the thread's share
    of rows) never changes an output (a greedy answer can hang on one rounding)."""
    rows, cols = 23, 160
    weight = quantized_weight(rows, cols, qtype, seed=11)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(12)).to(dtype)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(13))
    for isa in kernel_paths():
        together = quant_linear(x, weight.blocks, qtype, bias, isa)
        alone = torch.cat(
            [quant_linear(x, weight.blocks[i : i + 1], qtype, bias[i : i + 1], isa) for i in range(rows)],
            dim=1,
        )
        shifted = torch.cat(  # the groups start one row later: rows 1-4, 5-8, ...
            [
                quant_linear(x, weight.blocks[:1], qtype, bias[:1], isa),
                quant_linear(x, weight.blocks[1:], qtype, bias[1:], isa),
            ],
            dim=1,
        )
        assert torch.equal(together, alone) and torch.equal(together, shifted), f"path {isa}"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quant_linear_module_takes_strided_and_batched_inputs(dtype):
    """QuantLinear calls the kernel directly on a 2-D contiguous x and reshapes anything
    else: a column slice (row stride != K) and a 3-D input give the same rows."""
    weight = quantized_weight(13, 96, GGMLQuantizationType.Q4_1, seed=21)
    layer = QuantLinear(96, 13, GGMLQuantizationType.Q4_1)
    layer.load_rows(0, weight)
    wide = torch.randn(5, 200, generator=torch.Generator().manual_seed(22)).to(dtype)
    x = wide[:, 7:103]  # stride 200
    assert not x.is_contiguous()
    expected = quant_linear(x.contiguous(), weight.blocks, weight.qtype)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x.contiguous().view(1, 5, 96)), expected.view(1, 5, 13))
    reference = x.double() @ weight.dequantize().double().T
    bound = activation_rounding_bound(x, weight.dequantize()) + 1e-5 * (
        x.double().abs() @ weight.dequantize().double().abs().T
    )
    if dtype == torch.bfloat16:
        bound += reference.abs() * 2**-8
    assert ((layer(x).double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quant_linear_module_fills_rows_by_part_and_falls_back_to_the_dequantized_weight(qtype):
    first, second = quantized_weight(7, 64, qtype, seed=5), quantized_weight(9, 64, qtype, seed=6)
    layer = QuantLinear(64, 16, qtype, bias=True)
    layer.load_rows(0, first)
    layer.load_rows(7, second)
    assert layer.rows_loaded == 16
    with torch.no_grad():
        layer.bias.copy_(torch.arange(16.0))
    weight = torch.cat([first.dequantize(), second.dequantize()]).double()
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    # float64 activations take the fallback: F.linear on the exact dequantized weight
    torch.testing.assert_close(layer(x), x @ weight.T + torch.arange(16.0).double(), atol=1e-12, rtol=0)
    if load_cpu_ops():
        x32 = x.float()
        bound = activation_rounding_bound(x32, weight) + 1e-5 * (x32.double().abs() @ weight.abs().T)
        assert ((layer(x32).double() - (x @ weight.T + torch.arange(16.0).double())).abs() <= bound).all()


def test_quant_linear_module_refuses_a_weight_of_another_type_or_width():
    layer = QuantLinear(64, 8, GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_rows(0, quantized_weight(8, 64, GGMLQuantizationType.Q8_0, seed=0))
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_rows(0, quantized_weight(8, 96, GGMLQuantizationType.Q4_1, seed=0))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantLinear(40, 8, GGMLQuantizationType.Q8_0)
