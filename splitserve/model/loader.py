"""Read a checkpoint: a Hugging Face model directory (config.json, generation_config.json
and safetensors weights, single file or sharded via model.safetensors.index.json) or a
GGUF file (`splitserve.model.gguf_loader`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from splitserve.gguf_file import is_gguf_file
from splitserve.model.decoder_config import DecoderConfig, moe_config_from_hf

if TYPE_CHECKING:
    from splitserve.model.quant_linear import QuantizedTensor

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MistralForCausalLM": "llama",
}


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def load_decoder_config(model_path: str | Path) -> DecoderConfig:
    """The decoder's config from a model directory or a GGUF file."""
    if is_gguf_file(model_path):
        from splitserve.model.gguf_loader import load_gguf_config

        return load_gguf_config(model_path)
    model_dir = Path(model_path)
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    rope_scaling = raw.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type", "default") != "default" else None
    )
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type")
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        rope_scaling = tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, list)))
    eos = _as_id_list(raw.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += [t for t in _as_id_list(json.loads(gen_path.read_text()).get("eos_token_id")) if t not in eos]
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    if arch == "qwen2":
        attention_bias = True
    elif arch == "qwen2_moe":  # q, k and v only, as qwen2's
        attention_bias = bool(raw.get("qkv_bias", True))
    else:
        attention_bias = bool(raw.get("attention_bias", False))
    return DecoderConfig(
        arch=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling or None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        attention_bias=attention_bias,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=dtype,
        eos_token_ids=tuple(eos),
        moe=moe_config_from_hf(raw) if arch in ("qwen3_moe", "qwen2_moe") else None,
    )


def iter_checkpoint_weights(
    model_path: str | Path, quantized: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Every (Hugging Face name, tensor) of a model directory or a GGUF file; a GGUF
    file's Linears named in `quantized` come as their blocks (gguf_loader.quantization_plan)."""
    if is_gguf_file(model_path):
        from splitserve.model.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(model_path, quantized)
    return iter_safetensors(model_path)


def iter_safetensors(
    model_dir: str | Path, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, shard by shard; with `keep`, only the
    names it accepts (the others are never read from disk)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if keep is None or keep(key):
                    yield key, handle.get_tensor(key)
