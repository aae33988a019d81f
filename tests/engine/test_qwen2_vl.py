"""Qwen2-VL through splitserve's paged engine: greedy token IDs equal transformers'
`generate` with 0, 1, 2 and 4 images of different sizes, chunked or not, prefix hit or
miss; image hashes keep different images out of each other's prefix blocks."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from splitserve.engine.llm import LLM
from splitserve.frontend.image_processor import ImageProcessorConfig, process_image
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.multimodal import ImageInput
from tests.engine.vl_helpers import GREEDY, VLCase, picture, transformers_greedy
from tests.generate_requests import generate_request


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
    stats = llm.engine.multimodal.stats()
    assert stats.images_encoded == encoded and stats.images_loaded == 0
    assert stats.encoder_cache_hits > 0 and stats.encode_seconds > 0
    llm.engine.check_integrity()


def test_preempted_requests_with_images_equal_transformers(vl_model, vl_cases):
    """Too few blocks: a request is preempted and recomputed, its images included."""
    cases, expected = vl_cases
    llm = LLM(vl_model, num_blocks=14, max_num_batched_tokens=64)
    results = llm.generate([c.token_ids for c in cases], GREEDY, images=[c.images or None for c in cases])
    assert [r.token_ids for r in results] == expected
    assert llm.engine.stats().num_preemptions > 0
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
            llm.engine.add_request(generate_request(f"bad-{name}", case.token_ids, GREEDY, images=images))
        assert error.value.param == "images", name
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([case.token_ids], GREEDY, images=[case.images])[0].finish_reason == "length"
    text_llm = LLM(tiny_model, num_blocks=16)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_llm.engine.add_request(generate_request("img", [1, 2, 3], GREEDY, images=case.images))


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
        async for out in engine.generate(generate_request(request_id, case.token_ids, GREEDY, images=images)):
            tokens += out.new_token_ids
        return tokens

    with AsyncEngine(EngineConfig(ModelConfig(vl_model), CacheConfig(num_blocks=64))) as engine:
        with pytest.raises(InvalidRequestError, match="image token"):
            asyncio.run(run(engine, "bad", None))
        assert asyncio.run(run(engine, "good", case.images)) == expected[1]


def test_rendered_chat_through_the_wire_equals_transformers(vl_model):
    """Render tier → JSON features → engine: the token IDs and pixels the renderer makes
    from a chat request give transformers' greedy tokens."""
    import json

    from splitserve.frontend.render import RenderConfig, Renderer
    from splitserve.protocol.multimodal import features_from_wire
    from splitserve.protocol.openai_api import ChatCompletionRequest
    from tests.frontend.test_render_images import data_url, png

    encoded = [png(150, 100, 21), png(70, 70, 22, "JPEG")]
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first"},
                        {"type": "image_url", "image_url": {"url": data_url(encoded[0])}},
                        {"type": "image_url", "image_url": {"url": data_url(encoded[1], "image/jpeg")}},
                    ],
                }
            ]
        }
    )
    body = json.loads(json.dumps(Renderer(RenderConfig(model=vl_model)).render_chat(request).to_wire()))
    images = features_from_wire(body["features"], max_pixel_bytes=2**30)

    case = VLCase(vl_model, [], seed=0)
    case.token_ids, case.images = body["token_ids"], images
    case.pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in encoded]
    expected = transformers_greedy(vl_model, [case])
    result = LLM(vl_model, num_blocks=64).generate([body["token_ids"]], GREEDY, images=[images])[0]
    assert result.token_ids == expected[0]


def test_tiny_encoder_cache_reencodes_and_stays_exact(vl_model, vl_cases):
    """An encoder cache that holds one image: a second round (no prefix cache) finds every
    image evicted by the next one, encodes it again, and the output does not change."""
    cases, expected = vl_cases
    llm = LLM(
        vl_model,
        num_blocks=128,
        max_num_batched_tokens=16,
        encoder_cache_bytes=1,
        enable_prefix_caching=False,
    )
    prompts, images = [c.token_ids for c in cases], [c.images or None for c in cases]
    assert [r.token_ids for r in llm.generate(prompts, GREEDY, images=images)] == expected
    assert [r.token_ids for r in llm.generate(prompts, GREEDY, images=images)] == expected
    assert llm.engine.multimodal.stats().images_encoded == 14
    assert len(llm.engine.multimodal.cache.entries) == 1
