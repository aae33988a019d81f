"""A GGUF file served in its own quantized format (`--quantization gguf`, the default for
one): which layers stay quantized, and the Q4_1 demo model against its float32
dequantized weights: a sensible greedy answer, top-1 agreement and logit error measured
over the same token sequences (docs/engine-kernels.md has the figures)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from splitserve.engine.llm import LLM
from splitserve.frontend.chat_template import ChatTemplate
from splitserve.frontend.gguf_tokenizer import GGUFRenderFiles
from splitserve.gguf_file import shared_gguf_readers
from splitserve.model.attention import AttentionMetadata, PrefillChunk
from splitserve.model.gguf_loader import quantization_plan
from splitserve.model.linear import Linear
from splitserve.model.native import load_cpu_ops
from splitserve.model.quant_linear import MixedQuantLinear, QuantizedTensor, QuantLinear, RowTypes, row_bytes
from splitserve.protocol.sampling_params import SamplingParams
from tests.model.gguf_files import GGUF_SPEC, quantize_k, write_tiny_gguf

# not "What is the capital of France?": there the float32 model's first token leads its
# runner-up by 0.09 (The / L'), which any rounding flips (docs/engine-kernels.md)
QUESTIONS = ("Which river flows through Paris?", "Who wrote Romeo and Juliet?", "List three prime numbers.")


def logits_over(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [T, vocab] after each token of the sequence, in one prefill."""
    engine, count = llm.engine, len(token_ids)
    blocks = torch.arange(-(-count // engine.config.cache.block_size), dtype=torch.int32)
    no_decodes = torch.zeros(0, 0, dtype=torch.int32)
    meta = AttentionMetadata(
        torch.arange(count),
        0,
        no_decodes,
        torch.zeros(0, dtype=torch.int32),
        [PrefillChunk(0, count, 0, blocks)],
    )
    with torch.inference_mode():
        positions = torch.arange(count)
        return engine.model(torch.tensor(token_ids), positions, engine.kv_cache, meta, positions).float()


@pytest.mark.parametrize(
    ("qtype", "quantized"),
    [
        ("Q4_1", True),
        ("Q8_0", True),
        ("Q4_0", True),
        ("Q4_K", True),
        ("Q5_K", True),
        ("Q6_K", True),
        ("F16", False),
    ],
)
def test_projections_of_these_types_stay_quantized_others_are_dequantized(tmp_path, qtype, quantized):
    path = write_tiny_gguf(tmp_path / f"plan-{qtype}.gguf", GGUF_SPEC["qwen2"], qtype)
    llm = LLM(str(path), num_blocks=16, max_num_seqs=2)
    layers = [llm.engine.model.layers[0].self_attn.qkv_proj, llm.engine.model.layers[0].mlp.down_proj]
    assert all(isinstance(layer, QuantLinear if quantized else Linear) for layer in layers)
    assert llm.engine.model.embed_tokens.weight.dtype == llm.engine.dtype  # always dequantized
    if quantized:  # the activations stay float32, as llama.cpp's
        assert llm.engine.dtype == torch.float32 and layers[0].bias is not None  # qwen2's QKV bias
    prompt = [3, 5, 7, 11]
    assert len(llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids) == 4
    assert quantization_plan(str(path), "auto", "float32") == {}  # --dtype alone: dequantized
    assert quantization_plan(str(path), "none", None) == {}


def test_gguf_quantization_needs_a_gguf_file(tiny_model_factory):
    with pytest.raises(ValueError, match="needs a GGUF file"):
        quantization_plan(tiny_model_factory(arch="llama"), "gguf", None)


@pytest.fixture(scope="module")
def demo_pair(demo_model: Path) -> tuple[LLM, LLM]:
    with shared_gguf_readers():  # the file's metadata parsed once for both
        quantized = LLM(str(demo_model), num_blocks=64, max_num_seqs=4)
        reference = LLM(str(demo_model), num_blocks=64, max_num_seqs=4, dtype="float32", quantization="none")
    return quantized, reference


@pytest.fixture(scope="module")
def demo_continuations(
    demo_render_files: GGUFRenderFiles, demo_pair: tuple[LLM, LLM]
) -> list[tuple[list[int], list[int]]]:
    """The chat prompts and the float32 model's greedy continuations of them, generated
    once for every test that teacher-forces over them."""
    _, reference = demo_pair
    prompts = chat_prompts(demo_render_files)
    results = reference.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    return [(prompt, result.token_ids) for prompt, result in zip(prompts, results, strict=True)]


@pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
def test_demo_model_served_in_q4_1_answers_and_agrees_with_float32(
    demo_render_files, demo_pair, demo_continuations
):
    quantized, reference = demo_pair
    model = quantized.engine.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert model.layers[0].self_attn.qkv_proj.qtype.name == "Q4_1"
    assert model.lm_head.qtype.name == "Q8_0"  # tied: token_embd's blocks
    files = demo_render_files
    first_prompt = demo_continuations[0][0]
    answer = quantized.generate([first_prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in files.tokenizer.decode(answer.token_ids)  # as tests/service/test_demo_model.py asks
    # the same sequences (the reference's greedy continuations) through both models
    agree = total = 0
    worst_error = 0.0
    for prompt, continuation in demo_continuations:
        sequence = prompt + continuation
        ours, theirs = (logits_over(llm, sequence)[len(prompt) - 1 : -1] for llm in (quantized, reference))
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(continuation)
        worst_error = max(worst_error, float((ours - theirs).abs().max()))
    # measured: 0.96 top-1 and a worst logit error of 1.8 (logits up to ~38) over 6 prompts x 48 tokens
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
    assert 0.0 < worst_error < 4.0


# as llama.cpp's Q4_K_M mix stores them: most matrices Q4_K, ffn_down and the head Q6_K
Q4_K_M_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}


@pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
def test_k_quant_projections_stay_quantized_and_agree_with_float32(tmp_path):
    """llama (its Q/K rows un-permuted as blocks) in Q4_K with Q6_K attn_v, ffn_down and
    head (qkv_proj a MixedQuantLinear: Q4_K q and k rows, Q6_K v rows),
    against the same file dequantized to float32, teacher-forced over the float32 model's
    greedy continuation of random prompts."""
    path = write_tiny_gguf(tmp_path / "q4_k_m.gguf", GGUF_SPEC["llama"], "Q4_K", types=Q4_K_M_TYPES)
    quantized = LLM(str(path), num_blocks=32, max_num_seqs=2)
    reference = LLM(str(path), num_blocks=32, max_num_seqs=2, dtype="float32", quantization="none")
    model = quantized.engine.model
    kinds = {
        name: (module.qtype.name if isinstance(module, QuantLinear) else repr(module))
        for name, module in (
            ("qkv", model.layers[1].self_attn.qkv_proj),
            ("o", model.layers[1].self_attn.o_proj),
            ("gate_up", model.layers[1].mlp.gate_up_proj),
            ("down", model.layers[1].mlp.down_proj),
            ("head", model.lm_head),
        )
    }
    c = model.config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    mixed = f"parts=[Q4_K x{q_rows}, Q4_K x{kv_rows}, Q6_K x{kv_rows}]"
    assert mixed in kinds.pop("qkv")
    assert kinds == {"o": "Q4_K", "gate_up": "Q4_K", "down": "Q6_K", "head": "Q6_K"}
    prompts = [[3, 5, 7, 11, 13], [100, 200, 300, 400, 500, 600, 700]]
    continuations = reference.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    agree = total = 0
    worst_error = largest = 0.0
    for prompt, result in zip(prompts, continuations, strict=True):
        sequence = prompt + result.token_ids
        ours, theirs = (logits_over(llm, sequence)[len(prompt) - 1 : -1] for llm in (quantized, reference))
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(result.token_ids)
        worst_error = max(worst_error, float((ours - theirs).abs().max()))
        largest = max(largest, float(theirs.abs().max()))
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
    assert 0.0 < worst_error < 0.05 * largest, (worst_error, largest)


@pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
def test_a_fused_projection_of_mixed_types_stays_quantized_part_by_part(tmp_path):
    """attn_v in Q6_K beside Q4_K attn_q/attn_k (qwen2: q/k/v with biases): qkv_proj runs
    one kernel per part, adds the fused bias once, and its output equals the same parts
    dequantized through F.linear within the activations' int8 rounding."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", GGUF_SPEC["qwen2"], "Q4_K", types={"attn_v": "Q6_K"})
    plan = quantization_plan(str(path), "gguf", None)
    layout = plan["layers.0.self_attn.qkv_proj"]
    assert isinstance(layout, RowTypes)
    assert [qtype.name for qtype, _ in layout.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert plan["layers.0.self_attn.o_proj"].name == "Q4_K" and plan["lm_head"].name == "Q4_K"
    quantized = LLM(str(path), num_blocks=16, max_num_seqs=2)
    reference = LLM(str(path), num_blocks=16, max_num_seqs=2, dtype="float32", quantization="none")
    qkv = quantized.engine.model.layers[0].self_attn.qkv_proj
    dense = reference.engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, MixedQuantLinear) and qkv.bias is not None
    x = torch.randn(5, qkv.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = qkv(x), dense(x)
    assert ours.shape == theirs.shape == (5, qkv.out_features)
    assert float((ours - theirs).abs().max()) < 0.05 * float(theirs.abs().max())
    answer = quantized.generate([[3, 5, 7]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(answer.token_ids) == 3


def test_a_mixed_projection_refuses_a_weight_that_is_not_one_of_its_parts():
    row_types = RowTypes(((GGMLQuantizationType.Q4_K, 256), (GGMLQuantizationType.Q6_K, 256)))
    linear = MixedQuantLinear(256, row_types)
    blocks = torch.zeros(256, row_bytes(GGMLQuantizationType.Q6_K, 256), dtype=torch.uint8)
    with pytest.raises(ValueError, match="no part of"):
        linear.load_rows(128, QuantizedTensor(GGMLQuantizationType.Q6_K, blocks, (256, 256)))
    with pytest.raises(ValueError, match="does not fit"):  # the right rows in the wrong type
        linear.load_rows(0, QuantizedTensor(GGMLQuantizationType.Q6_K, blocks, (256, 256)))
    linear.load_rows(256, QuantizedTensor(GGMLQuantizationType.Q6_K, blocks, (256, 256)))
    assert linear.rows_loaded == 256


def chat_prompts(files: GGUFRenderFiles) -> list[list[int]]:
    template = ChatTemplate(files.chat_template, special_tokens=files.special_tokens)
    return [
        files.tokenizer.encode(template.render([{"role": "user", "content": q}], add_generation_prompt=True))
        for q in QUESTIONS
    ]


def swap_down_projs(llm: LLM, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Put `layers` in as the model's down_proj, one per decoder layer; the old ones back."""
    old = [layer.mlp.down_proj for layer in llm.engine.model.layers]
    for layer, new in zip(llm.engine.model.layers, layers, strict=True):
        layer.mlp.down_proj = new
    return old


@pytest.mark.skipif(not load_cpu_ops(), reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_demo_model_down_proj_in_k_quants_agrees_with_the_same_weights_in_float32(
    demo_pair, demo_continuations, qtype
):
    """The demo model's hidden size (576) is no multiple of 256: only its down_proj
    (K = 1536) can be a K-quant. Its weights quantized to `qtype` and multiplied by the
    kernel against the same dequantized weights through F.linear: the kernel's per-256
    int8 rounding of real (SiLU-gated) activations alone, teacher-forced over the float32
    model's greedy continuations."""
    _, reference = demo_pair
    float_layers, kernel_layers = [], []
    for layer in reference.engine.model.layers:
        weight = layer.mlp.down_proj.weight.detach()
        quantized = QuantizedTensor(
            GGMLQuantizationType[qtype],
            torch.from_numpy(quantize_k(weight.float().numpy(), qtype)),
            (weight.shape[0], weight.shape[1]),
        )
        dense = Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            dense.weight.copy_(quantized.dequantize())
        kernel = QuantLinear(weight.shape[1], weight.shape[0], quantized.qtype)
        kernel.load_rows(0, quantized)
        float_layers.append(dense)
        kernel_layers.append(kernel)
    originals = swap_down_projs(reference, float_layers)
    try:
        sequences = [prompt + continuation for prompt, continuation in demo_continuations]
        dense_logits = [logits_over(reference, s) for s in sequences]
        swap_down_projs(reference, kernel_layers)
        kernel_logits = [logits_over(reference, s) for s in sequences]
    finally:
        swap_down_projs(reference, originals)
    agree = total = 0
    worst_error = 0.0
    prompts = [prompt for prompt, _ in demo_continuations]
    for prompt, ours, theirs in zip(prompts, kernel_logits, dense_logits, strict=True):
        ours, theirs = ours[len(prompt) - 1 : -1], theirs[len(prompt) - 1 : -1]
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += ours.shape[0]
        worst_error = max(worst_error, float((ours - theirs).abs().max()))
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
    assert 0.0 < worst_error < 4.0
