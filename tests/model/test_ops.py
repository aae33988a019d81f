"""The compiled CPU kernels against their PyTorch references, and the references
against plain float64 arithmetic (so the fallback path is tested too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.model import ops
from splitserve.model.linear import Linear, can_prepack
from splitserve.model.native import load_cpu_ops

needs_kernels = pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
DTYPES = [torch.float32, torch.bfloat16]


def tolerances(dtype: torch.dtype) -> dict:
    # float32: summation order only; bf16: at most one rounding step of the dtype
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}


def random_paged_cache(
    context_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache whose blocks are shuffled among the sequences, and each one's block table."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed)
    tables, next_block = [], 0
    for n in needed:
        tables.append(order[next_block : next_block + n] + [0] * (width - n))
        next_block += n
    return cache, torch.tensor(tables, dtype=torch.int32)


def attention_float64(q, cache, tables, context_lens, scale) -> torch.Tensor:
    """Sequence by sequence, position by position, in float64."""
    seqs, heads, head_dim = q.shape
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    out = torch.empty(seqs, heads, head_dim, dtype=torch.float64)
    for b in range(seqs):
        n = int(context_lens[b])
        slots = [(int(tables[b, p // block_size]), p % block_size) for p in range(n)]
        keys = torch.stack([cache[0, blk, off] for blk, off in slots]).double()  # [n, kv_heads, D]
        values = torch.stack([cache[1, blk, off] for blk, off in slots]).double()
        for h in range(heads):
            kv = h // (heads // kv_heads)
            weights = torch.softmax(keys[:, kv] @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ values[:, kv]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (9, 3, 64), (4, 4, 16)])
def test_paged_decode_attention(dtype, heads, kv_heads, head_dim):
    # 1 token, inside one block, block-aligned, and long enough to be split in partitions
    context_lens = [1, 7, 16, 33, 256, 257, 700]
    cache, tables = random_paged_cache(context_lens, 16, kv_heads, head_dim, dtype)
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = attention_float64(q, cache, tables, lens, scale)

    reference = torch.empty_like(q)
    ops.paged_decode_attention_reference(reference, q, cache, tables, lens, scale)
    torch.testing.assert_close(reference.double(), expected, **tolerances(dtype))
    if load_cpu_ops():
        native = torch.empty_like(q)
        torch.ops.splitserve_cpu.paged_decode_attention(native, q, cache, tables, lens, scale)
        torch.testing.assert_close(native.double(), expected, **tolerances(dtype))


@needs_kernels
def test_paged_decode_attention_reads_strided_queries():
    """q as the decoder passes it: a view into the fused qkv rows."""
    cache, tables = random_paged_cache([5, 300], 16, 2, 32, torch.float32)
    qkv = torch.randn(2, (4 + 2 * 2) * 32)
    q = qkv[:, : 4 * 32].view(2, 4, 32)
    lens = torch.tensor([5, 300], dtype=torch.int32)
    native, reference = torch.empty(2, 4, 32), torch.empty(2, 4, 32)
    torch.ops.splitserve_cpu.paged_decode_attention(native, q, cache, tables, lens, 0.2)
    ops.paged_decode_attention_reference(reference, q, cache, tables, lens, 0.2)
    torch.testing.assert_close(native, reference)


def prefill_attention_float64(q, cache, table, position_start, scale) -> torch.Tensor:
    """Every query row against the keys up to its own position, in float64."""
    tokens, heads, head_dim = q.shape
    kv_heads = cache.shape[3]
    context = position_start + tokens
    keys = cache[0, table.long()].reshape(-1, kv_heads, head_dim)[:context].double()
    values = cache[1, table.long()].reshape(-1, kv_heads, head_dim)[:context].double()
    visible = torch.arange(context)[None, :] <= (position_start + torch.arange(tokens))[:, None]
    out = torch.empty(tokens, heads, head_dim, dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = (q[:, h].double() @ keys[:, kv].T * scale).masked_fill(~visible, float("-inf"))
        out[:, h] = scores.softmax(-1) @ values[:, kv]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(8, 4, 64), (9, 3, 64), (4, 4, 16), (4, 2, 32), (2, 1, 128)]
)
@pytest.mark.parametrize(("tokens", "position_start"), [(1, 0), (37, 0), (300, 0), (33, 100), (20, 700)])
def test_prefill_attention(dtype, heads, kv_heads, head_dim, tokens, position_start):
    """A chunk's queries (a view into fused qkv rows, as the decoder passes them) after a
    cached prefix or none; the kernel (bf16, where built) and the reference."""
    context = position_start + tokens
    cache, tables = random_paged_cache([context], 16, kv_heads, head_dim, dtype, seed=tokens)
    table = tables[0]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    scale = head_dim**-0.5
    expected = prefill_attention_float64(q, cache, table, position_start, scale)

    reference = torch.empty_like(q)
    ops.prefill_attention_reference(reference, q, cache, table, position_start, scale)
    torch.testing.assert_close(reference.double(), expected, **tolerances(dtype))
    dispatched = torch.empty_like(q)
    ops.prefill_attention(dispatched, q, cache, table, position_start, scale)
    torch.testing.assert_close(dispatched.double(), expected, **tolerances(dtype))


@needs_kernels
def test_prefill_attention_kernel_runs_where_built():
    """Where the CPU has AVX512-BF16 the bf16 kernel serves every head size the models use."""
    supported = [torch.ops.splitserve_cpu.prefill_attention_supported(d) for d in (16, 32, 64, 128)]
    assert all(supported) or not any(supported)
    if not any(supported):
        pytest.skip("this CPU has no AVX512-BF16: the reference runs")
    assert not torch.ops.splitserve_cpu.prefill_attention_supported(80)
    cache, tables = random_paged_cache([40], 16, 2, 64, torch.bfloat16)
    q = torch.randn(40, 4, 64).to(torch.bfloat16)
    out = torch.empty_like(q)
    torch.ops.splitserve_cpu.prefill_attention(out, q, cache, tables[0], 0, 0.125)
    torch.testing.assert_close(
        out.double(), prefill_attention_float64(q, cache, tables[0], 0, 0.125), **tolerances(torch.bfloat16)
    )
    with pytest.raises(RuntimeError, match="too short"):
        torch.ops.splitserve_cpu.prefill_attention(out, q, cache, tables[0][:1], 0, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_equals_torch_argmax(dtype):
    """First maximum on ties, a NaN beats every number (the first NaN), as torch.argmax."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49152, generator=gen).to(dtype)
    x[1, :] = 1.0  # all tied: index 0
    x[2, 100] = x[2, 40000] = 1e4  # tie between two maxima: the first
    x[3, 7] = float("nan")
    x[3, 9] = 1e4
    x[4, :] = float("-inf")
    x[5, 30000] = float("nan")
    x[5, 20] = float("nan")
    assert ops.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 0, 100, 7, 0, 20]
    strided = x[:, ::2]  # not contiguous rows: the reference path
    assert ops.argmax_rows(strided).tolist() == strided.argmax(dim=-1).tolist()


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(dtype):
    x = (torch.randn(37, 576) * 3).to(dtype)
    delta = torch.randn(37, 576).to(dtype)
    weight = (torch.rand(576) + 0.5).to(dtype)
    torch.testing.assert_close(
        ops.rms_norm_reference(x, weight, 1e-6).double(),
        rms_norm_float64(x, weight, 1e-6),
        **tolerances(dtype),
    )
    if not load_cpu_ops():
        return
    native = torch.empty_like(x)
    torch.ops.splitserve_cpu.rms_norm(native, x, weight, 1e-6)
    torch.testing.assert_close(native, ops.rms_norm_reference(x, weight, 1e-6), **tolerances(dtype))

    residual_native, residual_reference = x.clone(), x.clone()
    native = torch.empty_like(x)
    torch.ops.splitserve_cpu.add_rms_norm(native, residual_native, delta, weight, 1e-6)
    residual_reference.add_(delta)
    assert torch.equal(residual_native, residual_reference)  # one rounding, the same one
    torch.testing.assert_close(
        native, ops.rms_norm_reference(residual_reference, weight, 1e-6), **tolerances(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gate_up = (torch.randn(9, 2 * 160) * 4).to(dtype)
    reference = F.silu(gate_up[:, :160]) * gate_up[:, 160:]
    torch.testing.assert_close(ops.silu_and_mul(gate_up), reference, **tolerances(dtype))
    with torch.no_grad():  # the reference path as CUDA runs it
        gate, up = gate_up.double().chunk(2, dim=-1)
        torch.testing.assert_close(reference.double(), gate * torch.sigmoid(gate) * up, **tolerances(dtype))


def rope_float64(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The textbook rotate-half RoPE: x [tokens, heads, D]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    x = x.double()
    rotated = torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache(dtype, qk_norm):
    heads, kv_heads, head_dim, block_size, theta = 4, 2, 32, 16, 10000.0
    tokens = 21
    positions = torch.randint(0, 500, (tokens,))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq
    sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
    cos = angles.cos().repeat(1, 2).to(dtype)
    sin = (angles.sin().repeat(1, 2).to(dtype) * sign.to(dtype)).contiguous()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    norm_weight = (torch.rand(heads + kv_heads, head_dim) + 0.5).to(dtype) if qk_norm else None
    slots = torch.randperm(4 * block_size)[:tokens]

    def run(fn) -> tuple[torch.Tensor, torch.Tensor]:
        out, cache = qkv.clone(), torch.zeros(2, 4, block_size, kv_heads, head_dim, dtype=dtype)
        fn(out, cos, sin, norm_weight, 1e-6, cache, slots, heads, kv_heads)
        return out, cache

    reference, reference_cache = run(ops.rope_and_cache_reference)
    rotated = (heads + kv_heads) * head_dim
    qk = qkv[:, :rotated].view(tokens, heads + kv_heads, head_dim)
    if norm_weight is not None:
        qk = rms_norm_float64(qk, norm_weight, 1e-6)
    expected = rope_float64(qk, positions, theta).view(tokens, -1)
    loose = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 6e-2, "rtol": 3e-2}
    torch.testing.assert_close(reference[:, :rotated].double(), expected, **loose)
    flat_keys = reference_cache[0].view(-1, kv_heads * head_dim)
    assert torch.equal(flat_keys[slots], reference[:, heads * head_dim : rotated])
    assert torch.equal(reference_cache[1].view(-1, kv_heads * head_dim)[slots], qkv[:, rotated:])
    if load_cpu_ops():
        native, native_cache = run(torch.ops.splitserve_cpu.rope_and_cache)
        torch.testing.assert_close(native, reference, **tolerances(dtype))
        torch.testing.assert_close(native_cache, reference_cache, **tolerances(dtype))


@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_f_linear(bias):
    layer = Linear(96, 200, bias=bias).to(torch.bfloat16)
    weight, bias_value = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach()
    # the oneDNN path (tests/model/test_gemv_bf16.py tests the bf16 GEMV kernel's)
    layer.prepack(gemv=False)
    if not can_prepack(weight):
        assert layer.packed_weight is None
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        if bias_value is None:
            assert torch.equal(layer(x), F.linear(x, weight, bias_value))
        else:
            # oneDNN adds the bias before or after rounding to bf16 depending on the ISA
            # (seen on a CI machine): at most one bf16 step apart, never more
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias_value), rtol=1.6e-2, atol=1e-2)


def test_float32_linear_is_not_prepacked():
    layer = Linear(8, 4)
    layer.prepack()
    assert layer.packed_weight is None and layer.weight is not None
