"""The vision-language half of `splitserve tiny-model`: a random Qwen2-VL directory.

Laid out as the Qwen2-VL checkpoints on the Hub are (config.json with a nested
vision_config and M-RoPE sections, preprocessor_config.json, a chat template that puts
`<|vision_start|><|image_pad|><|vision_end|>` where an image goes, weights named
`model.*` for the language model and `visual.*` for the vision tower), so that
transformers' `Qwen2VLForConditionalGeneration` and `AutoProcessor` load it unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from splitserve.model.tiny_text import (
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tokenizer,
    check_spec,
    random_weights,
    write_tokenizer,
)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class TinyVisionSpec:
    depth: int = 2
    embed_dim: int = 32
    heads: int = 2
    mlp_ratio: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    # at most 256 visual tokens per image: tests and benchmarks stay small
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 256


def mrope_section(head_dim: int) -> list[int]:
    """Rotary pairs for time, height and width, in Qwen2-VL's 16:24:24 proportion."""
    pairs = head_dim // 2
    height = width = pairs * 3 // 8
    return [pairs - height - width, height, width]


def qwen2_vl_template() -> str:
    return resources.files("splitserve.model").joinpath("qwen2_vl_template.jinja").read_text()


def _config(spec: TinyModelSpec, vision: TinyVisionSpec, token_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.resolved_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section(spec.resolved_head_dim)},
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": spec.max_position,
        "max_window_layers": spec.layers,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_token_id": token_ids["<|vision_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "vision_config": {
            "depth": vision.depth,
            "embed_dim": vision.embed_dim,
            "mlp_ratio": vision.mlp_ratio,
            "num_heads": vision.heads,
            "in_chans": 3,
            "hidden_size": spec.hidden,
            "hidden_act": "quick_gelu",
            "patch_size": vision.patch_size,
            "spatial_merge_size": vision.merge_size,
            "temporal_patch_size": vision.temporal_patch_size,
        },
    }


def _preprocessor_config(vision: TinyVisionSpec) -> dict:
    return {
        "min_pixels": vision.min_pixels,
        "max_pixels": vision.max_pixels,
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.merge_size,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }


def vision_weights(spec: TinyModelSpec, vision: TinyVisionSpec) -> dict[str, np.ndarray]:
    """Random vision-tower weights under HF's `visual.*` names, scaled like the text ones
    so that visual embeddings are O(1) and move the language model's logits."""
    rng = np.random.default_rng(spec.seed + 1)
    dim, mlp = vision.embed_dim, vision.embed_dim * vision.mlp_ratio
    merged = dim * vision.merge_size**2

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.sqrt(in_dim)

    def vector(size: int, center: float = 0.0) -> np.ndarray:
        return (center + 0.1 * rng.standard_normal(size)).astype(np.float32)

    patch_in = 3 * vision.temporal_patch_size * vision.patch_size**2
    weights = {
        "visual.patch_embed.proj.weight": linear(dim, patch_in).reshape(
            dim, 3, vision.temporal_patch_size, vision.patch_size, vision.patch_size
        )
    }
    for i in range(vision.depth):
        p = f"visual.blocks.{i}."
        weights |= {
            p + "norm1.weight": vector(dim, 1.0),
            p + "norm1.bias": vector(dim),
            p + "norm2.weight": vector(dim, 1.0),
            p + "norm2.bias": vector(dim),
            p + "attn.qkv.weight": linear(3 * dim, dim),
            p + "attn.qkv.bias": vector(3 * dim),
            p + "attn.proj.weight": linear(dim, dim),
            p + "attn.proj.bias": vector(dim),
            p + "mlp.fc1.weight": linear(mlp, dim),
            p + "mlp.fc1.bias": vector(mlp),
            p + "mlp.fc2.weight": linear(dim, mlp),
            p + "mlp.fc2.bias": vector(dim),
        }
    weights |= {
        "visual.merger.ln_q.weight": vector(dim, 1.0),
        "visual.merger.ln_q.bias": vector(dim),
        "visual.merger.mlp.0.weight": linear(merged, merged),
        "visual.merger.mlp.0.bias": vector(merged),
        "visual.merger.mlp.2.weight": linear(spec.hidden, merged) * 2.0,
        "visual.merger.mlp.2.bias": vector(spec.hidden),
    }
    return weights


def write_tiny_qwen2_vl(out: Path, spec: TinyModelSpec, vision: TinyVisionSpec = TinyVisionSpec()) -> Path:
    """Write the model into the directory `out`; `spec`'s arch is "qwen2_vl"."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import AddedToken

    check_spec(spec)
    if spec.head_dim not in (None, spec.hidden // spec.heads):
        raise ValueError("qwen2_vl's head_dim is hidden / heads")
    if vision.embed_dim % vision.heads or (vision.embed_dim // vision.heads) % 4:
        raise ValueError("the vision head dim must divide by 4 (2-D rotary over height and width)")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab - len(VISION_TOKENS), spec.seed)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    token_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + VISION_TOKENS}
    template = qwen2_vl_template()
    write_tokenizer(
        out, tokenizer, SPECIAL_TOKENS + VISION_TOKENS + MARKUP_TOKENS, template, spec.max_position
    )
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(vision), indent=2))
    (out / "config.json").write_text(json.dumps(_config(spec, vision, token_ids), indent=2))
    generation_config = {
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        "pad_token_id": token_ids["<|endoftext|>"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))

    weights = random_weights(dataclasses.replace(spec, arch="qwen2")) | vision_weights(spec, vision)
    dtype = getattr(torch, spec.dtype)
    tensors = {name: torch.from_numpy(w).to(dtype).contiguous() for name, w in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
