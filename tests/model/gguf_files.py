"""Small GGUF files written with ggml-org's `gguf` writer, as llama.cpp's converter would
write them: llama.cpp tensor names, llama's Q/K rows permuted for its RoPE layout, norms
in F32 and every matrix in the quantization type under test."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

from splitserve.model.tiny_text import (
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tokenizer,
    chat_template,
)
from splitserve.model.tiny_text import random_weights as tiny_random_weights

QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# K-quant blocks hold 256 values: every matrix row is a multiple of 256 long. qwen3 has
# head_dim 128, the one transformers' GGUF loading assumes for it (it reads no key_length).
GGUF_SPEC = {
    arch: TinyModelSpec(
        arch=arch,
        layers=2,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=128 if arch == "qwen3" else 64,
        intermediate=512,
        vocab=1024,
    )
    for arch in ("llama", "qwen2", "qwen3")
}
# The pre-tokenizer each test file names (tokenizer.ggml.pre): one of each family.
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "gpt-2"}

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# K-quant block layouts: bytes per block, and the byte offset of each float16 scale with
# the range drawn for it, chosen so that weights come out O(1/sqrt(256)) and centred
# (Q4_K and Q5_K subtract dmin * m from d * scale * q).
_K_BLOCKS = {
    "Q4_K": (144, {0: (1e-4, 3e-4), 2: (7e-4, 2e-3)}),
    "Q5_K": (176, {0: (5e-5, 1.5e-4), 2: (7e-4, 2e-3)}),
    "Q6_K": (210, {208: (3e-5, 8e-5)}),
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter `permute`: each head's two rotary halves interleaved."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Raw K-quant blocks: random bits with small positive float16 scales (the `gguf`
    package dequantizes K-quants but cannot quantize to them)."""
    block_bytes, scale_ranges = _K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset, (low, high) in scale_ranges.items():
        scales = rng.uniform(low, high, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 256 * block_bytes)


def quantize_k(values: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) as Q4_K, Q5_K or Q6_K blocks, bytes as
    llama.cpp lays them out; a plain min/max (Q4_K, Q5_K) or absmax (Q6_K) rounding per
    sub-block, not llama.cpp's searched scales: real blocks of real weights, somewhat
    coarser than llama-quantize's."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 256)
    if qtype == "Q6_K":
        groups = x.reshape(-1, 16, 16)
        group_scale = np.abs(groups).max(axis=-1) / 31  # q - 32 in -31..31
        d = (group_scale.max(axis=-1) / 127).astype(np.float16)
        scales = np.round(group_scale / np.where(d > 0, d, 1).astype(np.float32)[:, None]).astype(np.int8)
        step = d.astype(np.float32)[:, None] * scales
        q = np.clip(np.round(groups / np.where(step > 0, step, 1)[..., None]), -32, 31).astype(np.int16) + 32
        q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [block, half, s, l]: element 128h + 32s + l
        low = q & 15  # uint8: << 4 drops the high bits, which qh holds
        ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
        qh = (
            (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        )
        blocks = [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            scales.view(np.uint8),
            d.view(np.uint8).reshape(-1, 2),
        ]
        return np.concatenate(blocks, axis=-1).reshape(rows, cols // 256 * 210)
    levels = 31 if qtype == "Q5_K" else 15
    subs = x.reshape(-1, 8, 32)
    low = np.minimum(subs.min(axis=-1), 0.0)
    sub_scale, sub_min = (subs.max(axis=-1) - low) / levels, -low
    d = (sub_scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (sub_min.max(axis=-1) / 63).astype(np.float16)
    sc = np.round(sub_scale / np.where(d > 0, d, 1).astype(np.float32)[:, None]).astype(np.uint8)
    m = np.round(sub_min / np.where(dmin > 0, dmin, 1).astype(np.float32)[:, None]).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.round((subs + offset[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)  # [block, j, l]
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=-1,
    )
    nibbles = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]
    if qtype == "Q5_K":
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append(nibbles)
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(rows, -1)


def _tokenizer_metadata(spec: TinyModelSpec) -> tuple[list[str], list[int], list[str], int, int]:
    tokenizer = build_tokenizer(spec.vocab, spec.seed)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    kinds = [
        TokenType.CONTROL
        if t in SPECIAL_TOKENS
        else TokenType.USER_DEFINED
        if t in MARKUP_TOKENS
        else TokenType.NORMAL
        for t in tokens
    ]
    merges = [
        m if isinstance(m, str) else " ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]
    ]
    return (
        tokens,
        [int(k) for k in kinds],
        merges,
        tokenizer.token_to_id("<|im_end|>"),
        tokenizer.token_to_id("<|endoftext|>"),
    )


def write_tiny_gguf(
    path: Path,
    spec: TinyModelSpec,
    qtype: str,
    architecture: str | None = None,
    types: Mapping[str, str] | None = None,
) -> Path:
    """A GGUF of `spec`'s random weights; matrices in `qtype`, norms and biases in F32.
    `architecture` overrides the name the file states (general.architecture); `types`
    gives some matrices another type, by llama.cpp's name for them (`attn_v`, `ffn_down`,
    `output`, `token_embd`), as a Q4_K_M file stores attn_v and ffn_down in Q6_K."""
    quant = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(spec.seed + 1)
    writer = GGUFWriter(str(path), architecture or spec.arch)
    writer.add_context_length(spec.max_position)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.resolved_intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(spec.resolved_head_dim)
    writer.add_key_length(spec.resolved_head_dim)
    writer.add_value_length(spec.resolved_head_dim)
    writer.add_file_type(int(quant))
    tokens, kinds, merges, eos_id, pad_id = _tokenizer_metadata(spec)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER[spec.arch])
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(eos_id)
    writer.add_bos_token_id(pad_id)
    writer.add_pad_token_id(pad_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template())
    for hf_name, weight in tiny_random_weights(spec).items():
        name = gguf_name(hf_name)
        tensor_type = (types or {}).get(name.removesuffix(".weight").rpartition(".")[2], qtype)
        tensor_quant = GGMLQuantizationType[tensor_type]
        if hf_name.endswith("q_proj.weight") and spec.arch == "llama":
            weight = permute_for_llama_cpp(weight, spec.heads)
        if hf_name.endswith("k_proj.weight") and spec.arch == "llama":
            weight = permute_for_llama_cpp(weight, spec.kv_heads)
        if weight.ndim == 1 or tensor_quant == GGMLQuantizationType.F32:
            writer.add_tensor(name, weight.astype(np.float32))
        elif tensor_type in _K_BLOCKS:
            blocks = random_k_blocks(weight.shape[0], weight.shape[1], tensor_type, rng)
            writer.add_tensor(name, blocks, raw_dtype=tensor_quant)
        else:
            writer.add_tensor(name, quantize(weight, tensor_quant), raw_dtype=tensor_quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
