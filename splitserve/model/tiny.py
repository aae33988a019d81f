"""`splitserve tiny-model`: a complete Hugging Face model directory with random weights.

The directory is what tests and benchmarks run on (the demo model is a real one,
`splitserve.model_files.demo`): config.json,
model.safetensors, generation_config.json, tokenizer.json and a tokenizer_config.json
holding the chat template (tiny_text.py builds a text decoder, tiny_vl.py a Qwen2-VL,
tiny_hybrid.py a Nemotron-H).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from splitserve.model.tiny_hybrid import DEFAULT_PATTERN, write_tiny_nemotron_h
from splitserve.model.tiny_moe import TinyMoeSpec
from splitserve.model.tiny_text import ARCHITECTURES, TinyModelSpec, write_tiny_text_model
from splitserve.model.tiny_vl import TinyVisionSpec, write_tiny_qwen2_vl

ARCHITECTURE_CHOICES = (*sorted(ARCHITECTURES), "qwen2_vl", "nemotron_h")


def write_tiny_model(
    directory: str | os.PathLike[str],
    spec: TinyModelSpec = TinyModelSpec(),
    vision: TinyVisionSpec | None = None,  # qwen2_vl's vision tower; None: TinyVisionSpec()
    pattern: str | None = None,  # nemotron_h's layers (M, *, -, E); None: DEFAULT_PATTERN
) -> Path:
    """The model directory for `spec`: a text decoder, Qwen2-VL for arch "qwen2_vl", or
    Nemotron-H for arch "nemotron_h" (its layers from `pattern`, not spec.layers)."""
    if spec.arch == "qwen2_vl":
        return write_tiny_qwen2_vl(Path(directory), spec, vision or TinyVisionSpec())
    if spec.arch == "nemotron_h":
        return write_tiny_nemotron_h(directory, spec, pattern or DEFAULT_PATTERN)
    return write_tiny_text_model(directory, spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyModelSpec()
    parser.add_argument("directory", help="output directory")
    parser.add_argument("--arch", choices=ARCHITECTURE_CHOICES, default=defaults.arch)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    parser.add_argument("--intermediate", type=int, default=None, help="default: 3 x hidden")
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--max-position", type=int, default=defaults.max_position)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=defaults.dtype)
    experts = parser.add_argument_group("qwen3_moe and qwen2_moe experts")
    experts.add_argument("--experts", type=int, default=defaults.moe.experts)
    experts.add_argument("--experts-per-token", type=int, default=defaults.moe.experts_per_token)
    experts.add_argument("--moe-intermediate", type=int, default=None, help="default: hidden")
    parser.add_argument(
        "--pattern",
        default=None,
        help=f"nemotron_h's layers: M Mamba2, * attention, - MLP, E experts (default {DEFAULT_PATTERN}; "
        "replaces --layers)",
    )
    vision = parser.add_argument_group("qwen2_vl's vision tower")
    vision.add_argument("--vision-depth", type=int, default=None, help="blocks (default 2)")
    vision.add_argument("--vision-dim", type=int, default=None, help="embedding width (default 32)")
    vision.add_argument("--vision-heads", type=int, default=None, help="attention heads (default 2)")


def run(args: argparse.Namespace) -> int:
    for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "max_position"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"splitserve tiny-model: --{name.replace('_', '-')} must be positive")
    spec = TinyModelSpec(
        arch=args.arch,
        seed=args.seed,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position=args.max_position,
        dtype=args.dtype,
        moe=TinyMoeSpec(
            experts=args.experts, experts_per_token=args.experts_per_token, intermediate=args.moe_intermediate
        ),
    )
    vision = None
    vision_args = {"depth": args.vision_depth, "embed_dim": args.vision_dim, "heads": args.vision_heads}
    if any(value is not None for value in vision_args.values()):
        if spec.arch != "qwen2_vl":
            raise SystemExit("splitserve tiny-model: --vision-* options need --arch qwen2_vl")
        vision = TinyVisionSpec(**{k: v for k, v in vision_args.items() if v is not None})
    if args.pattern is not None and spec.arch != "nemotron_h":
        raise SystemExit("splitserve tiny-model: --pattern needs --arch nemotron_h")
    try:
        out = write_tiny_model(args.directory, spec, vision, args.pattern)
    except ValueError as exc:
        raise SystemExit(f"splitserve tiny-model: {exc}") from exc
    layers = len(args.pattern or DEFAULT_PATTERN) if spec.arch == "nemotron_h" else spec.layers
    print(f"wrote {spec.arch} model ({layers} layers, hidden {spec.hidden}, vocab {spec.vocab}) to {out}")
    return 0
