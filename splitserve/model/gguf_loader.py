"""GGUF checkpoints (llama.cpp's format) for the llama, qwen2 and qwen3 architectures.

The metadata becomes a `DecoderConfig`; the tensors are dequantized with the `gguf`
package into float32 and renamed to Hugging Face names, so `DecoderModel.load_weights`
fills (and casts to the compute dtype) exactly as it does from safetensors. With
`--quantization gguf` (the default for a GGUF file when no --dtype is named) the
projections stored as Q8_0/Q4_0/Q4_1 or as the K-quants Q4_K/Q5_K/Q6_K stay in their
blocks instead (quant_linear.py).
llama.cpp's converter permutes the rows of llama's Q and K projections for its own RoPE
layout (pairs interleaved instead of halves): that permutation is undone here.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from splitserve.gguf_file import GGUFError, is_gguf_file, metadata_value, open_gguf
from splitserve.model.decoder_config import BF16_WHERE_NATIVE, DecoderConfig
from splitserve.model.quant_linear import BLOCK_SIZE, QUANTIZED_TYPES, QuantizedTensor, QuantLayout, RowTypes

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_QUANT_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"unsupported GGUF tensor {gguf_name!r} (not part of a llama/qwen2/qwen3 decoder)")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _check_supported(reader: GGUFReader, path: str | Path) -> str:
    """The architecture; a GGUFError naming whatever this loader cannot take."""
    arch = metadata_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
            raise GGUFError(
                f"{path}: tensor {tensor.name!r} uses quantization type {tensor.tensor_type.name}, "
                f"which is unsupported; supported: {supported}"
            )
        hf_tensor_name(tensor.name)
    return arch


def _tensor_rows(reader: GGUFReader, name: str) -> int | None:
    """The number of rows (the outer dimension) of a 2-D tensor, None if absent."""
    for tensor in reader.tensors:
        if tensor.name == name:
            return int(tensor.shape[-1])  # GGUF lists dimensions innermost first
    return None


def gguf_decoder_config(reader: GGUFReader, path: str | Path) -> DecoderConfig:
    arch = _check_supported(reader, path)

    def key(name: str, default: object = None) -> object:
        value = metadata_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{path}: GGUF metadata lacks {arch}.{name}")
        if isinstance(value, list):
            raise GGUFError(f"{path}: {arch}.{name} varies by layer, which is unsupported")
        return value

    hidden = int(key("embedding_length"))  # type: ignore[arg-type]
    heads = int(key("attention.head_count"))  # type: ignore[arg-type]
    head_dim = int(key("attention.key_length", hidden // heads))  # type: ignore[arg-type]
    rotary_dim = int(key("rope.dimension_count", head_dim))  # type: ignore[arg-type]
    if rotary_dim != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings ({rotary_dim} of {head_dim}) are unsupported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"{path}: per-frequency RoPE factors (rope_freqs, llama3 scaling) are unsupported")
    scaling_type = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = (("factor", float(key("rope.scaling.factor"))), ("rope_type", "linear"))  # type: ignore[arg-type]
    elif scaling_type != "none":
        raise GGUFError(f"{path}: unsupported RoPE scaling {scaling_type!r}")
    vocab = _tensor_rows(reader, "token_embd.weight")
    if vocab is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    eos = [
        int(token_id)
        for name in ("eos_token_id", "eot_token_id")
        if (token_id := metadata_value(reader, f"tokenizer.ggml.{name}")) is not None
    ]
    return DecoderConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),  # type: ignore[arg-type]
        num_layers=int(key("block_count")),  # type: ignore[arg-type]
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),  # type: ignore[arg-type]
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        rope_theta=float(key("rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length")),  # type: ignore[arg-type]
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_word_embeddings=_tensor_rows(reader, "output.weight") is None,
        # Dequantized values are exact in float32 (f16 scales times small integers), and
        # bf16 halves the bytes each decode step reads; --dtype float32 keeps them exact.
        dtype=BF16_WHERE_NATIVE,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def load_gguf_config(path: str | Path) -> DecoderConfig:
    return gguf_decoder_config(open_gguf(path), path)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows: per head it stores the rotary pairs
    interleaved (x0, x_half, x1, x_half+1, ...); Hugging Face keeps the two halves."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# the decoder's fused matmuls: a part's name -> the module it is rows of
_FUSED_PROJECTIONS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_PROJECTIONS = (*_FUSED_PROJECTIONS, "o_proj", "down_proj")


def linear_module_name(hf_name: str) -> str | None:
    """The decoder's Linear a weight fills (`layers.3.self_attn.qkv_proj` for q_proj's,
    `lm_head` for the output's), None for what is no projection weight."""
    if hf_name == "lm_head.weight":
        return "lm_head"
    module, _, kind = hf_name.removeprefix("model.").rpartition(".")
    parent, _, part = module.rpartition(".")
    if kind != "weight" or part not in _PROJECTIONS:
        return None
    return f"{parent}.{_FUSED_PROJECTIONS.get(part, part)}"


def quantized_linears(path: str | Path) -> dict[str, QuantLayout]:
    """The decoder's Linears whose every part the file stores as one of Q8_0, Q4_0, Q4_1,
    Q4_K, Q5_K, Q6_K (module name -> its type; a RowTypes for a fused Linear whose parts
    differ in type, as a Q4_K_M file's Q4_K attn_q/attn_k beside a Q6_K attn_v): they stay
    quantized. A Linear's in_features must be a multiple of each of its types' block (32;
    256 for the K-quants' super-blocks), else it stays dequantized. A tied lm_head takes
    token_embd's type; the embedding table itself, and tensors of other types, are
    dequantized."""
    reader = open_gguf(path)
    parts: dict[str, dict[str, tuple[GGMLQuantizationType, int]]] = {}  # module -> part -> (type, rows)
    widths: dict[str, int] = {}
    for tensor in reader.tensors:
        name = "lm_head.weight" if tensor.name == "output.weight" else hf_tensor_name(tensor.name)
        module = linear_module_name(name)
        if module is not None:
            part = name.removesuffix(".weight").rpartition(".")[2]
            # GGUF lists dimensions innermost first: (in_features, rows)
            parts.setdefault(module, {})[part] = (tensor.tensor_type, int(tensor.shape[1]))
            widths[module] = int(tensor.shape[0])
    if "lm_head" not in parts:  # tied: the head multiplies by the embedding table
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        parts["lm_head"] = {"lm_head": (embedding.tensor_type, int(embedding.shape[1]))}
        widths["lm_head"] = int(embedding.shape[0])
    plan: dict[str, QuantLayout] = {}
    for module, by_part in parts.items():
        types = {qtype for qtype, _ in by_part.values()}
        if not types <= QUANTIZED_TYPES or any(widths[module] % BLOCK_SIZE[t] for t in types):
            continue
        if len(types) == 1:
            plan[module] = types.pop()
        else:  # the decoder fuses the parts in _PROJECTIONS' order (q, k, v; gate, up)
            plan[module] = RowTypes(tuple(by_part[p] for p in _PROJECTIONS if p in by_part))
    return plan


def quantization_plan(model_path: str, quantization: str, dtype: str | None) -> dict[str, QuantLayout]:
    """Which Linears stay quantized: `gguf` asks for it (a GGUF file only), `auto` gives
    it to a GGUF file when no dtype is named, `none` never (ValueError for the rest)."""
    if quantization == "none":
        return {}
    if quantization not in ("gguf", "auto"):
        raise ValueError(f"unsupported quantization {quantization!r}; choose from auto, gguf, none")
    if not is_gguf_file(model_path):
        if quantization == "gguf":
            raise ValueError(f"quantization 'gguf' needs a GGUF file, not {model_path!r}")
        return {}
    if quantization == "auto" and dtype is not None:
        return {}  # --dtype alone keeps the dequantized weights
    return quantized_linears(model_path)


def iter_gguf_weights(
    path: str | Path, quantized: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Every tensor of the file under its Hugging Face name: dequantized to float32, or,
    for the Linears named in `quantized` (quantized_linears), as a QuantizedTensor."""
    reader = open_gguf(path)
    config = gguf_decoder_config(reader, path)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.name == "token_embd.weight" and config.tie_word_embeddings and "lm_head" in quantized:
            yield "lm_head.weight", quantized_tensor(tensor.data, tensor.tensor_type, shape)
        if linear_module_name(name) in quantized:
            blocks = tensor.data
            if config.arch == "llama" and ".q_proj." in name:
                blocks = unpermute_rope_rows(blocks, config.num_heads)
            elif config.arch == "llama" and ".k_proj." in name:
                blocks = unpermute_rope_rows(blocks, config.num_kv_heads)
            yield name, quantized_tensor(blocks, tensor.tensor_type, shape)
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except ValueError as exc:
            raise GGUFError(f"{path}: tensor {tensor.name!r} cannot be dequantized: {exc}") from exc
        if config.arch == "llama" and ".q_proj." in name:
            values = unpermute_rope_rows(values, config.num_heads)
        elif config.arch == "llama" and ".k_proj." in name:
            values = unpermute_rope_rows(values, config.num_kv_heads)
        # a copy: F32 tensors are read-only views of the memory-mapped file
        yield name, torch.from_numpy(np.array(values, dtype=np.float32, order="C"))


def quantized_tensor(
    blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> QuantizedTensor:
    # a copy: the blocks are a read-only view of the memory-mapped file
    return QuantizedTensor(
        qtype, torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C")), (shape[0], shape[1])
    )
