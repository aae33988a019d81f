"""The K-quant matmul (csrc/quant_matmul_k.cpp: Q4_K, Q5_K, Q6_K in 256-weight
super-blocks) against float64 arithmetic on gguf's own dequantization of the same bytes,
on every kernel path compiled in (VNNI, AVX2, scalar).

The bound is the int8 activation rounding's, per super-block of 256 now (llama.cpp's
q8_K): each value of x moves by at most d/2 with d = amax/127 over its 256, so an output
by at most sum over super-blocks of d_b/2 sum_i |w_i|; float32 scaling and summation of
the exact integer sums add ~1e-6 of sum |w||x|, a bf16 output one rounding step (2^-8).
The `gguf` package cannot quantize to the K-quants: the blocks are random bytes with sane
fp16 scales (every bit pattern is a valid block), and blocks at the extremes of each
field check that no int16 or int32 sum overflows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from splitserve.model.native import load_cpu_ops
from splitserve.model.quant_linear import K_QUANT_TYPES, QuantizedTensor, QuantLinear, quant_linear
from tests.model.gguf_files import random_k_blocks
from tests.model.test_quant_linear import activation_rounding_bound, kernel_paths

needs_kernels = pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
TYPES = sorted(K_QUANT_TYPES, key=lambda t: t.name)
SUPER = 256
# where each type keeps its fp16 scales (d, and dmin for Q4_K / Q5_K), and Q6_K its int8 ones
HALF_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
Q6_K_SCALES = slice(192, 208)


def k_weight(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> QuantizedTensor:
    blocks = random_k_blocks(rows, cols, qtype.name, np.random.default_rng(seed))
    return QuantizedTensor(qtype, torch.from_numpy(blocks), (rows, cols))


def check_every_path(weight: QuantizedTensor, x: torch.Tensor, bias: torch.Tensor | None) -> float:
    """Each path's output within the bound of float64 on the dequantized weight; the
    worst error/bound ratio seen."""
    dequantized = weight.dequantize().double()
    reference = x.double() @ dequantized.T + (0.0 if bias is None else bias.double())
    mass = x.double().abs() @ dequantized.abs().T
    bound = activation_rounding_bound(x, dequantized, block=SUPER) + 1e-5 * mass
    if x.dtype == torch.bfloat16:
        bound += reference.abs() * 2**-8
    worst = 0.0
    results = []
    for isa in kernel_paths():
        out = quant_linear(x, weight.blocks, weight.qtype, bias, isa)
        assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
        error = (out.double() - reference).abs()
        # an all-zero weight row has bound 0 and must come out exact
        ratio = float((error / bound.clamp_min(1e-300)).max())
        assert (error <= bound).all(), f"{weight.qtype.name} path {isa}: worst error/bound {ratio:.3f}"
        worst = max(worst, ratio)
        results.append(out.double())
    # the paths sum the same exact integers: float32 ordering apart, one result
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-5 * float(mass.max()), rtol=1e-3)
    return worst


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "cols", "rows"), [(1, 256, 37), (1, 1536, 1), (3, 512, 67), (17, 256, 5), (40, 768, 33)]
)
def test_k_quant_linear_within_the_activation_rounding_of_float64(qtype, dtype, tokens, cols, rows):
    weight = k_weight(rows, cols, qtype, seed=tokens + cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    check_every_path(weight, x, bias)


def extreme_blocks(qtype: GGMLQuantizationType, cols: int) -> QuantizedTensor:
    """Rows of super-blocks with every quant, scale and min field at its largest (all bits
    set), at zero, and Q6_K's int8 scales at -128 and 127; fp16 scales set to 0.01."""
    block_bytes = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype.name]
    blocks = np.zeros((4, cols // SUPER, block_bytes), dtype=np.uint8)
    blocks[0], blocks[2], blocks[3] = 0xFF, 0xFF, 0x00
    if qtype.name == "Q6_K":
        blocks[2, :, Q6_K_SCALES] = np.uint8(127)
        blocks[3, :, Q6_K_SCALES] = np.int8(-128).view(np.uint8)
    for offset in HALF_SCALE_OFFSETS[qtype.name]:
        blocks[..., offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return QuantizedTensor(qtype, torch.from_numpy(blocks.reshape(4, -1).copy()), (4, cols))


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_k_quant_linear_at_the_extremes_of_every_field(qtype):
    cols = 512
    x = torch.stack(
        [
            torch.ones(cols),  # every x quantized to 127: the largest integer sums
            -torch.ones(cols),
            torch.tensor([1.0, -1.0]).repeat(cols // 2),
            torch.randn(cols, generator=torch.Generator().manual_seed(2)) * 1e3,
        ]
    )
    check_every_path(extreme_blocks(qtype, cols), x, None)


def q8_k_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's q8_K sees it, in float64: per 256, rounded to multiples of amax/127."""
    blocks = x.double().reshape(x.shape[0], -1, SUPER)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127
    return (torch.round(blocks / step.clamp_min(1e-300)) * step).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_k_quant_linear_is_the_exact_product_of_x_rounded_per_256(qtype):
    """Against float64 on x rounded as q8_K does (per 256, not per 32), every path agrees
    to float32 summation alone, far inside the rounding bound: one large value in the
    first super-block rounds its other 255 (at most 0.003, under half a step) to zero,
    the second super-block keeps its own scale."""
    weight = k_weight(67, 512, qtype, seed=3)
    dequantized = weight.dequantize().double()
    generator = torch.Generator().manual_seed(4)
    x = (torch.rand(3, 512, generator=generator) - 0.5) * 0.006
    x[:, 0] = torch.tensor([1.0, -2.0, 0.5])
    x[2, 256:] = torch.randn(256, generator=generator)
    reference = q8_k_rounded(x) @ dequantized.T
    float32_error = 1e-5 * (x.double().abs() @ dequantized.abs().T)
    unrounded = x.double() @ dequantized.T
    assert ((unrounded - reference).abs() > 10 * float32_error).any()  # the rounding shows
    for isa in kernel_paths():
        out = quant_linear(x, weight.blocks, qtype, None, isa).double()
        assert ((out - reference).abs() <= float32_error).all(), f"path {isa}"
    assert 0.02 < check_every_path(weight, x, None) <= 1.0


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_k_quant_module_fills_rows_by_part_and_falls_back_to_the_dequantized_weight(qtype):
    first, second = k_weight(7, 256, qtype, seed=5), k_weight(9, 256, qtype, seed=6)
    layer = QuantLinear(256, 16, qtype, bias=True)
    layer.load_rows(0, first)
    layer.load_rows(7, second)
    assert layer.rows_loaded == 16 and layer.blocks.shape == (16, first.blocks.shape[1])
    with torch.no_grad():
        layer.bias.copy_(torch.arange(16.0))
    weight = torch.cat([first.dequantize(), second.dequantize()]).double()
    x = torch.randn(3, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    expected = x @ weight.T + torch.arange(16.0).double()
    # float64 activations take the fallback: F.linear on the exact dequantized weight
    torch.testing.assert_close(layer(x), expected, atol=1e-12, rtol=0)
    if load_cpu_ops():
        x32 = x.float()
        bound = activation_rounding_bound(x32, weight, block=SUPER) + 1e-5 * (
            x32.double().abs() @ weight.abs().T
        )
        assert ((layer(x32).double() - expected).abs() <= bound).all()


def test_k_quant_module_and_kernel_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantLinear(288, 8, GGMLQuantizationType.Q4_K)  # a multiple of 32, not of 256
    with pytest.raises(ValueError, match="cannot stay quantized"):
        QuantLinear(256, 8, GGMLQuantizationType.F16)
    layer = QuantLinear(256, 8, GGMLQuantizationType.Q6_K)
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_rows(0, k_weight(8, 256, GGMLQuantizationType.Q4_K, seed=0))
    if load_cpu_ops():
        weight = k_weight(8, 512, GGMLQuantizationType.Q4_K, seed=0)
        with pytest.raises(RuntimeError, match="multiple of 256"):
            quant_linear(torch.randn(1, 256), weight.blocks, weight.qtype)  # K of another width
        with pytest.raises(RuntimeError, match="unsupported GGML type"):
            torch.ops.splitserve_cpu.quant_linear_k(
                torch.empty(1, 8),
                torch.randn(1, 512),
                weight.blocks,
                int(GGMLQuantizationType.Q8_0),
                None,
                -1,
            )
