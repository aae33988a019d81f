"""The compiled decode step (model/decode_layers.py, csrc/decode_layers.cpp) equals the
decoder's module-by-module forward bit for bit: logits and every KV cache byte, over each
dense architecture, bf16 weights on the GEMV path and GGUF block types under float32 and
bf16 activations, batches of 1 to 3 decodes."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.model.attention import AttentionMetadata, PrefillChunk
from splitserve.model.linear import gemv_kernel_available
from splitserve.model.native import load_cpu_ops
from tests.model.gguf_files import GGUF_SPEC, write_tiny_gguf

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs the compiled CPU kernels")

CONTEXTS = (37, 5, 64)  # tokens each decoding sequence holds, this step's included
BLOCKS_PER_SEQUENCE = 5


def decode_step(llm: LLM, batch: int, hooked: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode-only step of `batch` sequences over a cache filled with seeded noise: the
    logits and the cache after it. `hooked` adds a no-op per-layer hook, which keeps the
    step on the module-by-module path."""
    engine = llm.engine
    kv_cache, block_size = engine.kv_cache, engine.config.cache.block_size
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        kv_cache.copy_(torch.randn(kv_cache.shape, generator=generator).to(kv_cache.dtype))
        lens = torch.tensor(CONTEXTS[:batch], dtype=torch.int32)
        tables = torch.arange(batch * BLOCKS_PER_SEQUENCE, dtype=torch.int32).view(batch, -1)
        positions = (lens - 1).long()
        slots = tables[torch.arange(batch), positions // block_size].long() * block_size + positions % block_size
        meta = AttentionMetadata(slots, batch, tables, lens, [])
        input_ids = torch.randint(0, 1000, (batch,), generator=generator)
        hook = (lambda i: None) if hooked else None
        logits = engine.model(input_ids, positions, kv_cache, meta, torch.arange(batch), before_layer=hook)
    return logits, kv_cache.clone()


def assert_fused_equals_modules(llm: LLM, batches: tuple[int, ...] = (1, 2, 3)) -> None:
    model = llm.engine.model
    for batch in batches:
        fused_logits, fused_cache = decode_step(llm, batch, hooked=False, seed=batch)
        assert model.decode_plans[llm.engine.dtype] is not None, "the compiled step did not apply"
        logits, cache = decode_step(llm, batch, hooked=True, seed=batch)
        assert torch.equal(fused_logits, logits)
        assert torch.equal(fused_cache, cache)


@pytest.mark.skipif(not gemv_kernel_available(), reason="the bf16 GEMV needs AVX512-BF16")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_weights_on_the_gemv_path(tiny_model_factory, arch):
    llm = LLM(tiny_model_factory(arch=arch), num_blocks=16, dtype="bfloat16")
    assert_fused_equals_modules(llm)


@pytest.mark.parametrize(
    ("arch", "qtype", "dtype"),
    [
        ("llama", "Q4_1", None),  # float32 activations, as a GGUF file is served by default
        ("qwen2", "Q8_0", None),  # QKV bias
        ("qwen3", "Q4_K", None),  # per-head q/k norms; a K-quant kernel
        ("llama", "Q6_K", "bfloat16"),
    ],
)
def test_gguf_blocks_under_float32_and_bf16_activations(tmp_path, arch, qtype, dtype):
    path = write_tiny_gguf(tmp_path / f"{arch}-{qtype}.gguf", GGUF_SPEC[arch], qtype)
    llm = LLM(str(path), num_blocks=16, **({"dtype": dtype} if dtype else {}))
    assert_fused_equals_modules(llm)


def test_steps_the_op_does_not_take_run_module_by_module(tiny_model_factory):
    """float32 weights (the oracle tests' path), a step with a prefill in it, and more bf16
    decodes than the GEMV takes keep the module-by-module forward."""
    float32 = LLM(tiny_model_factory(arch="llama"), num_blocks=16)
    decode_step(float32, 1, hooked=False)
    assert float32.engine.model.decode_plans[torch.float32] is None
    bf16 = LLM(tiny_model_factory(arch="llama"), num_blocks=64, dtype="bfloat16")
    model, kv_cache = bf16.engine.model, bf16.engine.kv_cache
    many = torch.arange(4, dtype=torch.int32)
    meta = AttentionMetadata(many.long(), 4, many.view(4, 1), torch.ones(4, dtype=torch.int32), [])
    residual = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert model.decode_plan(residual, many.long(), kv_cache, meta) is None
    with_prefill = meta._replace(prefills=[PrefillChunk(4, 2, 0, many)])
    assert model.decode_plan(residual[:1], many[:1].long(), kv_cache, with_prefill) is None
