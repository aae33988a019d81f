"""A 16-bit KV cache under float32 activations (--kv-cache-dtype; a quantized GGUF
model's default): the kernels and their references write K and V rounded to the cache's
dtype and attend over it in float32, against plain float64 arithmetic on the same cached
values."""

from __future__ import annotations

import pytest
import torch

from splitserve.model import ops
from splitserve.model.native import load_cpu_ops
from tests.model.test_ops import attention_float64, prefill_attention_float64, random_paged_cache

needs_kernels = pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
CACHE_DTYPES = [torch.bfloat16, torch.float16]
# float32 arithmetic over exactly representable cached values: summation order and the
# kernels' exp polynomial only
FLOAT32 = {"atol": 2e-5, "rtol": 2e-5}
# odd head counts (9 over 3: SmolLM2's), every AVX-512 head size and two the portable
# kernel serves (16 is not a multiple of 32 lanes of bf16 pairs; 80 has no AVX-512 kernel)
SHAPES = [(9, 3, 64), (4, 4, 16), (4, 2, 32), (2, 1, 128), (3, 1, 80)]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_decode_attention_reads_a_16_bit_cache_in_float32(cache_dtype, heads, kv_heads, head_dim):
    context_lens = [1, 7, 16, 33, 257, 700]
    cache, tables = random_paged_cache(context_lens, 16, kv_heads, head_dim, cache_dtype, seed=head_dim)
    q = torch.randn(len(context_lens), heads, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = attention_float64(q, cache, tables, lens, scale)

    reference = torch.empty_like(q)
    ops.paged_decode_attention_reference(reference, q, cache, tables, lens, scale)
    torch.testing.assert_close(reference.double(), expected, **FLOAT32)
    dispatched = torch.empty_like(q)  # the compiled kernel where built
    ops.paged_decode_attention(dispatched, q, cache, tables, lens, scale)
    assert dispatched.dtype == torch.float32
    torch.testing.assert_close(dispatched.double(), expected, **FLOAT32)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES[:3])
@pytest.mark.parametrize(("tokens", "position_start"), [(1, 0), (37, 0), (33, 100), (20, 700)])
def test_prefill_attention_reads_a_16_bit_cache_in_float32(
    cache_dtype, heads, kv_heads, head_dim, tokens, position_start
):
    context = position_start + tokens
    cache, tables = random_paged_cache([context], 16, kv_heads, head_dim, cache_dtype, seed=tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # a view, as the decoder passes it
    scale = head_dim**-0.5
    expected = prefill_attention_float64(q, cache, tables[0], position_start, scale)

    out = torch.empty_like(q)
    ops.prefill_attention(out, q, cache, tables[0], position_start, scale)
    torch.testing.assert_close(out.double(), expected, **FLOAT32)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_rounds_k_and_v_into_a_16_bit_cache(cache_dtype, qk_norm):
    """q, k (rotated) and v stay float32 in qkv; the cache holds k and v rounded to nearest
    even, as torch's conversion: the kernel's cache equals the reference's bit for bit."""
    heads, kv_heads, head_dim, block_size, tokens = 9, 3, 64, 16, 21
    positions = torch.randint(0, 500, (tokens,))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq
    sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
    cos, sin = angles.cos().repeat(1, 2), (angles.sin().repeat(1, 2) * sign).contiguous()
    qkv = 40 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)  # beyond bf16's exact integers
    norm_weight = torch.rand(heads + kv_heads, head_dim) + 0.5 if qk_norm else None
    slots = torch.randperm(4 * block_size)[:tokens]

    def run(fn, dtype: torch.dtype = cache_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        out = qkv.clone()
        cache = torch.zeros(2, 4, block_size, kv_heads, head_dim, dtype=dtype)
        fn(out, cos, sin, norm_weight, 1e-6, cache, slots, heads, kv_heads)
        return out, cache

    reference, reference_cache = run(ops.rope_and_cache_reference)
    float32_cache_run, _ = run(ops.rope_and_cache_reference, torch.float32)
    assert torch.equal(reference, float32_cache_run)  # the activations never see the cache's dtype
    rotated = (heads + kv_heads) * head_dim
    flat = reference_cache.view(2, -1, kv_heads * head_dim)
    assert torch.equal(flat[0][slots], reference[:, heads * head_dim : rotated].to(cache_dtype))
    assert torch.equal(flat[1][slots], qkv[:, rotated:].to(cache_dtype))
    if load_cpu_ops():
        native, native_cache = run(torch.ops.splitserve_cpu.rope_and_cache)
        torch.testing.assert_close(native, reference, atol=1e-4, rtol=1e-5)
        native_flat = native_cache.view(2, -1, kv_heads * head_dim)
        assert torch.equal(native_flat[0][slots], native[:, heads * head_dim : rotated].to(cache_dtype))
        assert torch.equal(native_flat[1][slots], reference_cache.view(2, -1, kv_heads * head_dim)[1][slots])


@needs_kernels
def test_kernels_refuse_a_cache_wider_than_the_activations():
    """Only float32 activations read another (16-bit) cache: a bf16 model over a float32
    cache is refused by name, never read as the wrong bytes."""
    cache, tables = random_paged_cache([20], 16, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or float16 under float32 activations"):
        torch.ops.splitserve_cpu.paged_decode_attention(
            torch.empty_like(q), q, cache, tables, torch.tensor([20], dtype=torch.int32), 0.125
        )
    qkv = torch.randn(1, 8 * 64).to(torch.bfloat16)
    cos = sin = torch.ones(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or float16 under float32 activations"):
        torch.ops.splitserve_cpu.rope_and_cache(qkv, cos, sin, None, 1e-6, cache, torch.tensor([0]), 4, 2)
