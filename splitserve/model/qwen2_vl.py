"""Qwen2-VL: the decoder (Qwen2 with M-RoPE) plus the vision tower.

The language model is splitserve's paged `DecoderModel`; what differs is only its rotary
positions. M-RoPE gives every token three positions (time, height, width); each head's
rotary pairs are split in three sections (`mrope_section`) that turn with one of them.
Text tokens have three equal positions, so a text-only prompt is plain RoPE; the visual
tokens of an image sit on a grid: time = start, height = start + row, width = start +
column, and the text after it continues from start + max(rows, columns). Generated tokens
continue at index + `delta` on all three axes.

Checkpoints load from both layouts: the Hub's (`model.layers.*`, `visual.*`) and the one
transformers 5 saves (`model.language_model.*`, `model.visual.*`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitserve.model.decoder import DecoderModel, rope_inv_freq
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.loader import iter_safetensors
from splitserve.model.materialize import materialize
from splitserve.model.vision import VisionConfig, VisionTransformer

QWEN2_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration",)


@dataclass(frozen=True)
class Qwen2VLConfig:
    text: DecoderConfig
    vision: VisionConfig
    mrope_section: tuple[int, int, int]  # rotary pairs turning with time, height, width
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def is_qwen2_vl(model_path: str | Path) -> bool:
    """A Hugging Face directory whose config.json names a Qwen2-VL (GGUF files never do)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return any(a in QWEN2_VL_ARCHITECTURES for a in raw.get("architectures") or [])


def _token_ids(value: object) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]  # type: ignore[union-attr]


def load_qwen2_vl_config(model_dir: str | Path) -> Qwen2VLConfig:
    """From a Hub config.json (flat text fields) or a transformers 5 one (`text_config`)."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    text = {**raw, **(raw.get("text_config") or {})}
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
    head_dim = hidden // heads
    if not section or len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} must be three numbers summing to head_dim / 2")
    eos = _token_ids(text.get("eos_token_id"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text())
        eos += [t for t in _token_ids(generation.get("eos_token_id")) if t not in eos]
    decoder = DecoderConfig(
        arch="qwen2",
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(text["intermediate_size"]),
        num_layers=int(text["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(text.get("rope_theta") or rope.get("rope_theta") or 1000000.0),
        rope_scaling=None,  # M-RoPE is plain RoPE per section, handled by Qwen2VLModel.rope
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        attention_bias=True,
        qk_norm=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
        dtype=str(raw.get("torch_dtype") or raw.get("dtype") or text.get("dtype") or "float32"),
        eos_token_ids=tuple(eos),
    )
    return Qwen2VLConfig(
        text=decoder,
        vision=VisionConfig.from_hf(raw["vision_config"], hidden),
        mrope_section=(int(section[0]), int(section[1]), int(section[2])),
        image_token_id=int(raw.get("image_token_id", 151655)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
    )


@dataclass(frozen=True)
class ImagePlacement:
    """An image's visual tokens: prompt positions [offset, offset + grid_t * grid_h *
    grid_w / merge²), laid out row-major over the merged grid."""

    offset: int
    grid_thw: tuple[int, int, int]


def mrope_positions(
    num_tokens: int, images: Sequence[ImagePlacement], merge: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, num_tokens] of a prompt, and the delta that positions every
    later token (index + delta on all three axes)."""
    rows: list[torch.Tensor] = []
    next_pos = index = 0
    for image in sorted(images, key=lambda i: i.offset):
        text_len = image.offset - index
        rows.append(torch.arange(next_pos, next_pos + text_len).expand(3, -1))
        next_pos += text_len
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        ).reshape(3, -1)
        rows.append(grid + next_pos)
        next_pos += max(h, w)
        index = image.offset + t * h * w
    rows.append(torch.arange(next_pos, next_pos + num_tokens - index).expand(3, -1))
    positions = torch.cat(rows, dim=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def hub_weight_name(name: str) -> str:
    """The Hub checkpoints' name of a weight saved as `model.language_model.*` or `model.visual.*`."""
    return name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")


def mrope_column_axis(section: tuple[int, int, int]) -> torch.Tensor:
    """For each rotary column of a head, the axis (0 time, 1 height, 2 width) whose
    position turns it: the sections in order, the same for both halves of the head."""
    # on the CPU even inside a meta-device build (see decoder.rope_inv_freq)
    half = torch.cat(
        [torch.full((n,), axis, dtype=torch.long, device="cpu") for axis, n in enumerate(section)]
    )
    return torch.cat([half, half])


class Qwen2VLTextModel(DecoderModel):
    """The paged decoder, its rotary positions [T] (plain RoPE) or [3, T] (M-RoPE)."""

    def __init__(self, config: DecoderConfig, mrope_section: tuple[int, int, int]) -> None:
        super().__init__(config)
        self.register_buffer("column_axis", mrope_column_axis(mrope_section), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim]; with M-RoPE each column from its axis' position."""
        if positions.dim() == 1:
            return super().rope(positions, dtype)
        num_tokens = positions.shape[1]
        cos, sin = super().rope(positions.reshape(-1), dtype)
        pick = self.column_axis.view(1, 1, -1).expand(1, num_tokens, -1)
        cos = cos.view(3, num_tokens, -1).gather(0, pick)[0]
        sin = sin.view(3, num_tokens, -1).gather(0, pick)[0]
        return cos, sin


class Qwen2VLModel(nn.Module):
    """Called like a DecoderModel (the engine's runner does not know it is a VL model);
    `encode_images` runs the vision tower, `embed_tokens` gives the text embeddings the
    visual ones are merged into."""

    def __init__(self, config: Qwen2VLConfig) -> None:
        super().__init__()
        self.config = config
        self.language_model = Qwen2VLTextModel(config.text, config.mrope_section)
        self.visual = VisionTransformer(config.vision)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.language_model(*args, **kwargs)

    def prepare_for_inference(self) -> None:
        self.language_model.prepare_for_inference()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Visual-token embeddings [sum of tokens, hidden] for one or more images."""
        return self.visual(pixel_values, grid_thw)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: list[tuple[str, torch.Tensor]] = []

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = hub_weight_name(name)
                if name.startswith("visual."):
                    vision.append((name.removeprefix("visual."), tensor))
                else:
                    yield name, tensor

        self.language_model.load_weights(text_weights())
        self.visual.load_weights(vision)


def load_qwen2_vl(
    model_dir: str, config: Qwen2VLConfig, dtype: torch.dtype, device: torch.device
) -> Qwen2VLModel:
    with torch.device("meta"):
        model = Qwen2VLModel(config)
    model = materialize(model, device).to(dtype)
    text = model.language_model
    text.inv_freq = rope_inv_freq(config.text).to(device)
    text.rope_cos = text.rope_sin = torch.empty(0, device=device)
    text.column_axis = mrope_column_axis(config.mrope_section).to(device)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()


def load_vision_tower(
    model_dir: str, config: Qwen2VLConfig, dtype: torch.dtype, device: torch.device
) -> VisionTransformer:
    """Only the vision tower (an encoder worker's model): the language model's weights
    are never read."""
    with torch.device("meta"):
        tower = VisionTransformer(config.vision)
    tower = materialize(tower, device).to(dtype)
    weights = iter_safetensors(model_dir, keep=lambda name: hub_weight_name(name).startswith("visual."))
    tower.load_weights((hub_weight_name(name).removeprefix("visual."), tensor) for name, tensor in weights)
    return tower.eval()
