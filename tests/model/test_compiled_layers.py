"""The compiled layers (model/compiled_layers.py, csrc/compiled_layers.cpp) equal the
decoder's module-by-module forward bit for bit: logits and every KV cache byte, over each
dense architecture; bf16 weights on the GEMV path (1 to 3 decodes) and on oneDNN's packed
path (more decodes, prefill chunks beside decodes); GGUF block types under float32 and
bf16 activations."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.model.attention import AttentionMetadata, PrefillChunk
from splitserve.model.linear import GEMV_MAX_ROWS, gemv_kernel_available
from splitserve.model.native import load_cpu_ops
from tests.model.gguf_files import GGUF_SPEC, write_tiny_gguf

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="needs the compiled CPU kernels")

CONTEXTS = (37, 5, 64)  # tokens each decoding sequence holds, this step's included
BLOCKS_PER_SEQUENCE = 5


def step(
    llm: LLM, decodes: int, hooked: bool, chunks: tuple[int, ...] = (), seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step over a cache filled with seeded noise: `decodes` one-token requests, then
    a prefill chunk of each length in `chunks` (the first after 20 cached tokens, the
    others from the start); the logits of every request and the cache after it. `hooked`
    adds a no-op per-layer hook, which keeps the step on the module-by-module path."""
    engine = llm.engine
    kv_cache, block_size = engine.kv_cache, engine.config.cache.block_size
    generator = torch.Generator().manual_seed(seed)
    requests = decodes + len(chunks)
    tables = torch.arange(requests * BLOCKS_PER_SEQUENCE, dtype=torch.int32).view(requests, -1)
    lens = torch.tensor(
        [CONTEXTS[i % len(CONTEXTS)] - i // len(CONTEXTS) for i in range(decodes)], dtype=torch.int32
    )
    positions = [(lens - 1).long()]
    slots = [
        tables[torch.arange(decodes), positions[0] // block_size].long() * block_size
        + positions[0] % block_size
    ]
    prefills, row = [], decodes
    for j, count in enumerate(chunks):
        start = 20 if j == 0 else 0
        table = tables[decodes + j]
        pos = torch.arange(start, start + count)
        positions.append(pos)
        slots.append(table[pos // block_size].long() * block_size + pos % block_size)
        prefills.append(PrefillChunk(row, count, start, table))
        row += count
    meta = AttentionMetadata(torch.cat(slots), decodes, tables[:decodes], lens, prefills)
    sampled = torch.tensor([*range(decodes), *(c.token_start + c.num_tokens - 1 for c in prefills)])
    with torch.inference_mode():
        kv_cache.copy_(torch.randn(kv_cache.shape, generator=generator).to(kv_cache.dtype))
        input_ids = torch.randint(0, 1000, (row,), generator=generator)
        hook = (lambda i: None) if hooked else None
        logits = engine.model(input_ids, torch.cat(positions), kv_cache, meta, sampled, before_layer=hook)
    return logits, kv_cache.clone()


def assert_compiled_equals_modules(llm: LLM, cases: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
    """For each (decodes, chunk lengths): the compiled step ran and equals the module path."""
    model = llm.engine.model
    for seed, (decodes, chunks) in enumerate(cases):
        compiled_logits, compiled_cache = step(llm, decodes, False, chunks, seed)
        tokens = decodes + sum(chunks)
        plan = model.layer_plans[llm.engine.dtype, tokens <= GEMV_MAX_ROWS]
        assert plan is not None, f"the compiled layers did not take {decodes} decodes, chunks {chunks}"
        logits, cache = step(llm, decodes, True, chunks, seed)
        assert torch.equal(compiled_logits, logits)
        assert torch.equal(compiled_cache, cache)


DECODES = ((1, ()), (2, ()), (3, ()))


@pytest.mark.skipif(not gemv_kernel_available(), reason="the bf16 GEMV needs AVX512-BF16")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_weights_on_the_gemv_and_packed_paths(tiny_model_factory, arch):
    llm = LLM(tiny_model_factory(arch=arch), num_blocks=64, dtype="bfloat16")
    # GEMV: 1-3 decodes; oneDNN's packed matmul: 8 decodes, a prefill beside 2 decodes,
    # two prefills alone (one after cached tokens)
    assert_compiled_equals_modules(llm, (*DECODES, (8, ()), (2, (13,)), (0, (5, 33))))


@pytest.mark.parametrize(
    ("arch", "qtype", "options"),
    [
        ("llama", "Q4_1", {}),  # float32 activations, as a GGUF file is served by default
        ("llama", "Q4_1", {"kv_cache_dtype": "float16"}),  # a 16-bit cache under them
        ("qwen2", "Q8_0", {}),  # QKV bias
        ("qwen3", "Q4_K", {}),  # per-head q/k norms; a K-quant kernel
        ("llama", "Q6_K", {"dtype": "bfloat16"}),
    ],
)
def test_gguf_blocks_under_float32_and_bf16_activations(tmp_path, arch, qtype, options):
    path = write_tiny_gguf(tmp_path / f"{arch}-{qtype}.gguf", GGUF_SPEC[arch], qtype)
    llm = LLM(str(path), num_blocks=64, **options)
    # float32 prefills run the reference attention, module by module
    prefills = ((2, (13,)),) if options.get("dtype") == "bfloat16" else ()
    assert_compiled_equals_modules(llm, (*DECODES, (8, ()), *prefills))


def test_steps_the_op_does_not_take_run_module_by_module(tiny_model_factory, tmp_path):
    """float32 weights (the oracle tests' path) and float32 prefills (reference attention)
    keep the module-by-module forward."""
    float32 = LLM(tiny_model_factory(arch="llama"), num_blocks=64)
    step(float32, 1, hooked=False)
    step(float32, 8, hooked=False)
    assert float32.engine.model.layer_plans == {(torch.float32, True): None, (torch.float32, False): None}
    path = write_tiny_gguf(tmp_path / "llama-Q4_1.gguf", GGUF_SPEC["llama"], "Q4_1")
    quantized = LLM(str(path), num_blocks=64)
    model, kv_cache = quantized.engine.model, quantized.engine.kv_cache
    rows = torch.arange(4)
    meta = AttentionMetadata(
        rows, 1, rows[:1].view(1, 1).int(), rows[1:2].int(), [PrefillChunk(1, 3, 0, rows.int())]
    )
    assert model.compiled_plan(torch.zeros(4, 256), rows, kv_cache, meta) is None
    assert (
        model.compiled_plan(torch.zeros(1, 256), rows[:1], kv_cache, meta._replace(prefills=[])) is not None
    )
