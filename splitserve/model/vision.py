"""Qwen2-VL's vision tower: patch embedding, ViT blocks with 2-D rotary, 2×2 patch merger.

Input: the render tier's patches (`splitserve.frontend.image_processor`), float
[num_patches, channels * temporal * patch * patch], patches of each 2×2 merge block
contiguous; output: one embedding in the language model's hidden size per visual token
(per 2×2 patches). Attention never crosses images. Numerics follow transformers
(rotary in float32, LayerNorm eps 1e-6, quick-GELU in the blocks, exact GELU in the merger).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    out_hidden_size: int  # the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_input_size(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, raw: dict, out_hidden_size: int) -> VisionConfig:
        act = raw.get("hidden_act", "quick_gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {act!r}; supported: {sorted(_ACTIVATIONS)}")
        return cls(
            depth=int(raw["depth"]),
            embed_dim=int(raw["embed_dim"]),
            num_heads=int(raw["num_heads"]),
            mlp_ratio=float(raw.get("mlp_ratio", 4)),
            out_hidden_size=int(raw.get("hidden_size") or out_hidden_size),
            in_channels=int(raw.get("in_chans") or raw.get("in_channels") or 3),
            patch_size=int(raw.get("patch_size", 14)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
            hidden_act=act,
        )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [num_patches, 2], in the processor's order: merge
    blocks row-major, the patches of a block row-major inside it, repeated over time."""
    positions = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(positions)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim, mlp_dim = config.embed_dim, int(config.embed_dim * config.mlp_ratio)
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, dim)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, image_lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cos, sin, image_lengths)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    def attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, image_lengths: list[int]
    ) -> torch.Tensor:
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).reshape(num_patches, 3, self.num_heads, -1).unbind(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        outputs = []
        # each image attends only to itself
        for q_i, k_i, v_i in zip(*(t.split(image_lengths) for t in (q, k, v)), strict=True):
            out = F.scaled_dot_product_attention(
                q_i.transpose(0, 1)[None], k_i.transpose(0, 1)[None], v_i.transpose(0, 1)[None]
            )
            outputs.append(out[0].transpose(0, 1))
        return self.proj(torch.cat(outputs).reshape(num_patches, -1))


class PatchMerger(nn.Module):
    """LayerNorm, then each 2×2 block of patch features → one language-model embedding."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.merged_dim))))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_embed = nn.Conv3d(c.in_channels, c.embed_dim, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)

    def rotary(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
        """cos, sin [num_patches, 1, head_dim] (float32): the first half of each head's
        rotary pairs turns with the patch's row, the second half with its column."""
        half = self.config.head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float, device=device) / half
        inv_freq = 1.0 / (self.config.rope_theta**exponents)
        positions = patch_positions(grid_thw, self.config.spatial_merge_size).to(device)
        angles = (positions[..., None].float() * inv_freq).flatten(1)  # [N, rows then columns]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patches of one or more images → [sum of visual tokens, out_hidden_size]."""
        c = self.config
        weight = self.patch_embed.weight
        patches = pixel_values.to(weight.dtype).view(
            -1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size
        )
        x = self.patch_embed(patches).view(-1, c.embed_dim)
        cos, sin = self.rotary(grid_thw, x.device)
        image_lengths = [t * h * w for t, h, w in grid_thw]
        for block in self.blocks:
            x = block(x, cos, sin, image_lengths)
        return self.merger(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill from HF names under `visual.` (prefix removed). Raises ValueError for
        unknown names, wrong shapes and missing weights."""
        params = dict(self.named_parameters())
        renames = {
            "patch_embed.proj.": "patch_embed.",
            "attn.qkv.": "qkv.",
            "attn.proj.": "proj.",
            "mlp.fc1.": "fc1.",
            "mlp.fc2.": "fc2.",
        }
        renames |= {"merger.mlp.0.": "merger.fc1.", "merger.mlp.2.": "merger.fc2."}
        loaded = set()
        for name, tensor in weights:
            target = name
            for old, new in renames.items():
                target = target.replace(old, new)
            if target not in params:
                raise ValueError(f"unexpected vision weight {name!r}")
            if params[target].shape != tensor.shape:
                raise ValueError(
                    f"vision weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(params[target].shape)}"
                )
            with torch.no_grad():
                params[target].copy_(tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks vision weights for {missing[:5]}")
