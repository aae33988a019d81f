"""The bf16 GEMV kernel (csrc/gemv_bf16.cpp) against float64 arithmetic on the same bf16
values, and linear.Linear on it against F.linear, with its oneDNN fallback forced.

The kernel sums in float32 and rounds once to bf16. Its output therefore differs from the
exact (float64) value by at most half a bf16 step of the float32 sum (2^-8 relative:
bf16 keeps 8 significant bits) plus the float32 summation error, bounded by
(K + 2) 2^-24 sum |x||w| (a chain of K additions, the bias one more).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.model.linear import GEMV_MAX_ROWS, Linear, can_prepack, gemv_kernel_available

needs_gemv = pytest.mark.skipif(not gemv_kernel_available(), reason="bf16 GEMV kernel not built for this CPU")


def float32_sum_error(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, N]: how far a float32 summation of x W^T (+ b), in any order, can be from exact."""
    mass = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        mass = mass + bias.double().abs()
    return (x.shape[1] + 2) * 2.0**-24 * mass


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """One bf16 step (ulp) at each value's magnitude (float64)."""
    magnitude = values.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    torch.ops.splitserve_cpu.gemv_bf16(out, x, weight, bias)
    return out


@needs_gemv
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    # N not a multiple of the 4-row group, K not a multiple of 32 (masked tail), K < 32,
    # M 1..4 and beyond one 4-row tile of x; 131 x 577 is split over threads
    [(1, 1, 7), (1, 37, 45), (2, 130, 96), (3, 67, 577), (4, 131, 577), (5, 9, 64), (9, 262, 160)],
)
def test_gemv_within_bf16_rounding_of_float64(rows, n, k, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=generator).to(torch.bfloat16) if bias else None
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    out = gemv(x, weight, b)
    summation = float32_sum_error(x, weight, b)
    bound = 2.0**-8 * (exact.abs() + summation) + summation
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.3f}"
    if out.numel() >= 32:
        # bf16 rounding is the error's bulk: a bound several times too loose would hide a bug
        assert (error / bound).max() > 0.3


@needs_gemv
def test_gemv_edge_cases():
    weight = torch.randn(5, 40).to(torch.bfloat16)
    assert gemv(torch.zeros(0, 40, dtype=torch.bfloat16), weight, None).shape == (0, 5)
    # one large term among small ones: each output is that product alone, rounded once
    x = torch.zeros(1, 40, dtype=torch.bfloat16)
    x[0, 39] = 3.0  # in the masked tail (40 = 32 + 8)
    assert torch.equal(gemv(x, weight, None), (weight[:, 39].float() * 3.0).to(torch.bfloat16)[None])
    with pytest.raises(RuntimeError, match="bf16"):
        gemv(x.float(), weight, None)
    with pytest.raises(RuntimeError, match="weight"):
        gemv(x, weight.T.contiguous().T, None)


def assert_within_one_bf16_step(actual: torch.Tensor, expected: torch.Tensor, slack: torch.Tensor) -> None:
    """Each element within one bf16 step of the larger, plus both float32 sums' slack."""
    diff = (actual.double() - expected.double()).abs()
    step = bf16_step(torch.maximum(actual.double().abs(), expected.double().abs()))
    assert (diff <= step + 2 * slack).all(), f"worst {(diff / (step + 2 * slack)).max():.3f} steps"


@pytest.mark.parametrize("gemv_on", [True, False], ids=["gemv", "onednn_fallback"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_linear_equals_f_linear_within_one_bf16_step(gemv_on, bias):
    layer = Linear(96, 203, bias=bias).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    bias_value = None if layer.bias is None else layer.bias.detach().clone()
    layer.prepack(gemv=gemv_on)
    uses_gemv = gemv_on and gemv_kernel_available()
    assert layer.gemv_max_rows == (GEMV_MAX_ROWS if uses_gemv else 0)
    # oneDNN's packed copy serves the larger inputs either way; the plain weight stays for the GEMV
    assert (layer.packed_weight is not None) == can_prepack(weight)
    assert (layer.weight is not None) == (uses_gemv or not can_prepack(weight))
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, GEMV_MAX_ROWS + 1, 64):
            x = torch.randn(2, rows, 96).to(torch.bfloat16)  # a leading dim: forward flattens it
            out = layer(x)
            expected = F.linear(x, weight, bias_value)
            assert out.shape == expected.shape and out.dtype == torch.bfloat16
            slack = float32_sum_error(x.reshape(-1, 96), weight, bias_value).view(expected.shape)
            assert_within_one_bf16_step(out, expected, slack)
            if uses_gemv and 2 * rows <= GEMV_MAX_ROWS:  # the kernel ran, not oneDNN
                assert torch.equal(out.view(-1, 203), gemv(x.reshape(-1, 96), weight, bias_value))


@needs_gemv
def test_gemv_linear_keeps_a_tied_weight_shared():
    embedding = torch.nn.Embedding(50, 32).to(torch.bfloat16)
    head = Linear(32, 50, bias=False).to(torch.bfloat16)
    head.weight = embedding.weight
    head.prepack()
    assert head.weight is embedding.weight and head.gemv_max_rows == GEMV_MAX_ROWS
