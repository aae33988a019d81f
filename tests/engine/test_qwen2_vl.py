"""Qwen2-VL through splitserve's paged engine: greedy token IDs equal transformers'
`generate` with 0, 1, 2 and 4 images of different sizes, chunked or not, prefix hit or
miss; image hashes keep different images out of each other's prefix blocks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.llm import LLM
from splitserve.engine.multimodal import ImageInput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.frontend.image_processor import ImageProcessorConfig, process_image
from splitserve.model.qwen2_vl import load_qwen2_vl_config

MAX_TOKENS = 10
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
        for image in self.pictures:
            processed = process_image(image, processor)
            self.token_ids.append(config.vision_start_token_id)
            self.images.append(
                ImageInput(
                    processed.image_hash, len(self.token_ids), processed.grid_thw, processed.pixel_values
                )
            )
            self.token_ids += [config.image_token_id] * processed.num_visual_tokens
            self.token_ids.append(config.vision_end_token_id)
            self.token_ids += [rng.randrange(10, 1500) for _ in range(rng.randrange(1, 12))]


def transformers_greedy(model_dir: str, cases: list[VLCase]) -> list[list[int]]:
    """The oracle: transformers' model and its own image processor."""
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


@pytest.fixture(scope="module")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


@pytest.fixture(scope="module")
def vl_cases(vl_model):
    cases = [
        VLCase(vl_model, [(90, 130)], seed=1),
        VLCase(vl_model, [(200, 120), (56, 56)], seed=2),
        VLCase(vl_model, [(64, 300), (150, 150), (57, 90), (260, 70)], seed=3),
        VLCase(vl_model, [], seed=4),  # text only
    ]
    return cases, transformers_greedy(vl_model, cases)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16])
def test_greedy_equals_transformers(vl_model, vl_cases, max_num_batched_tokens):
    cases, expected = vl_cases
    assert [len(c.images) for c in cases] == [1, 2, 4, 0]
    llm = LLM(vl_model, num_blocks=128, max_num_batched_tokens=max_num_batched_tokens)
    prompts = [c.token_ids for c in cases]
    images = [c.images or None for c in cases]
    results = llm.generate(prompts, GREEDY, images=images)
    assert [r.token_ids for r in results] == expected
    encoded = llm.engine.multimodal.num_images_encoded
    assert encoded == 7  # each image once, even when chunks split it

    # again: prefixes (visual tokens included) come from the prefix cache, the encoder cache
    # supplies what is recomputed, nothing is encoded twice
    again = llm.generate(prompts, GREEDY, images=images)
    assert [r.token_ids for r in again] == expected
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert llm.engine.multimodal.num_images_encoded == encoded
    llm.engine.check_integrity()


def test_different_images_never_share_prefix_blocks(vl_model):
    """Same token IDs (same placeholder count), different pixels: the blocks covering the
    image differ in hash, so the second request reuses only the blocks before the image."""
    first = VLCase(vl_model, [(120, 120)], seed=5)
    second = VLCase(vl_model, [(120, 120)], seed=5)
    other_pixels = process_image(picture(120, 120, seed=999), ImageProcessorConfig.from_model_dir(vl_model))
    image = second.images[0]
    second.pictures = [picture(120, 120, seed=999)]
    second.images = [
        ImageInput(other_pixels.image_hash, image.offset, other_pixels.grid_thw, other_pixels.pixel_values)
    ]
    assert second.token_ids == first.token_ids and other_pixels.image_hash != first.images[0].image_hash
    expected = transformers_greedy(vl_model, [first, second])
    assert expected[0] != expected[1]  # the image matters

    llm = LLM(vl_model, num_blocks=64)
    out_first = llm.generate([first.token_ids], GREEDY, images=[first.images])[0]
    out_second = llm.generate([second.token_ids], GREEDY, images=[second.images])[0]
    assert [out_first.token_ids, out_second.token_ids] == expected
    assert out_second.num_cached_tokens == image.offset // 16 * 16  # blocks before the image only
    # the first image again: every full block hits, the image is not encoded again
    repeat = llm.generate([first.token_ids], GREEDY, images=[first.images])[0]
    assert repeat.token_ids == expected[0]
    assert repeat.num_cached_tokens == (len(first.token_ids) - 1) // 16 * 16
    assert llm.engine.multimodal.num_images_encoded == 2


def test_inconsistent_images_are_refused(vl_model, tiny_model):
    case = VLCase(vl_model, [(90, 90)], seed=6)
    llm = LLM(vl_model, num_blocks=32)
    image = case.images[0]
    bad = {
        "placeholders without an image": None,
        "offset off the placeholders": [
            ImageInput(image.image_hash, image.offset - 1, image.grid_thw, image.pixel_values)
        ],
        "grid not matching the count": [
            ImageInput(image.image_hash, image.offset, (1, 2, 2), image.pixel_values[:4])
        ],
        "pixels of another shape": [
            ImageInput(image.image_hash, image.offset, image.grid_thw, image.pixel_values[:, :10])
        ],
    }
    for name, images in bad.items():
        with pytest.raises(InvalidRequestError) as error:
            llm.engine.add_request(f"bad-{name}", case.token_ids, GREEDY, images=images)
        assert error.value.param == "images", name
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([case.token_ids], GREEDY, images=[case.images])[0].finish_reason == "length"
    text_llm = LLM(tiny_model, num_blocks=16)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_llm.engine.add_request("img", [1, 2, 3], GREEDY, images=case.images)


def test_async_engine_takes_images(vl_model, vl_cases):
    """The serving path's engine: images go through AsyncEngine.generate; bad ones raise
    at the first __anext__, before any output, and the engine keeps serving."""
    import asyncio

    from splitserve.config import CacheConfig, EngineConfig, ModelConfig
    from splitserve.engine.async_engine import AsyncEngine

    cases, expected = vl_cases
    case = cases[1]

    async def run(engine: AsyncEngine, request_id: str, images) -> list[int]:
        tokens = []
        async for out in engine.generate(request_id, case.token_ids, GREEDY, images=images):
            tokens += out.new_token_ids
        return tokens

    with AsyncEngine(EngineConfig(ModelConfig(vl_model), CacheConfig(num_blocks=64))) as engine:
        with pytest.raises(InvalidRequestError, match="image token"):
            asyncio.run(run(engine, "bad", None))
        assert asyncio.run(run(engine, "good", case.images)) == expected[1]
