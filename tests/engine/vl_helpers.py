"""Shared helpers for the vision-language engine tests: prompts with images, and
transformers' Qwen2-VL as the oracle (with its own image processor)."""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image

from splitserve.frontend.image_processor import ImageProcessorConfig, process_image
from splitserve.model.qwen2_vl import load_qwen2_vl_config
from splitserve.protocol.multimodal import ImageInput
from splitserve.protocol.sampling_params import SamplingParams

MAX_TOKENS = 24  # long enough that a decode-position error (M-RoPE's delta) shows
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // width, yy * 255 // height, (xx ^ yy) & 255], -1).astype(np.float64)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))


class VLCase:
    """A prompt of text and images: token IDs with one <|image_pad|> per visual token."""

    def __init__(self, model_dir: str, sizes: list[tuple[int, int]], seed: int) -> None:
        config = load_qwen2_vl_config(model_dir)
        processor = ImageProcessorConfig.from_model_dir(model_dir)
        rng = random.Random(seed)
        self.pictures = [picture(w, h, seed * 10 + i) for i, (w, h) in enumerate(sizes)]
        self.token_ids: list[int] = [rng.randrange(10, 1500) for _ in range(rng.randrange(3, 20))]
        self.images: list[ImageInput] = []
        self.num_visual_tokens: list[int] = []
        for image in self.pictures:
            processed = process_image(image, processor)
            self.token_ids.append(config.vision_start_token_id)
            self.images.append(
                ImageInput(
                    processed.image_hash, len(self.token_ids), processed.grid_thw, processed.pixel_values
                )
            )
            self.token_ids += [config.image_token_id] * processed.num_visual_tokens
            self.num_visual_tokens.append(processed.num_visual_tokens)
            self.token_ids.append(config.vision_end_token_id)
            self.token_ids += [rng.randrange(10, 1500) for _ in range(rng.randrange(1, 12))]


def transformers_greedy(model_dir: str, cases: list[VLCase]) -> list[list[int]]:
    """The oracle: transformers' model and its own image processor. `mm_token_type_ids`
    (which tokens are visual) is what transformers' processor returns beside the input IDs;
    without it transformers 5 warns and gives the prompt plain text positions, not M-RoPE's,
    and its output drifts from the right one after the first tokens."""
    from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    outputs = []
    with torch.inference_mode():
        for case in cases:
            ids = torch.tensor([case.token_ids])
            kwargs = {}
            if case.pictures:
                pixels = image_processor(images=case.pictures, return_tensors="pt")
                kwargs = {
                    "pixel_values": pixels["pixel_values"],
                    "image_grid_thw": pixels["image_grid_thw"],
                    "mm_token_type_ids": (ids == model.config.image_token_id).int(),
                }
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **kwargs,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs
