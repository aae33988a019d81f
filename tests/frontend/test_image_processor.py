"""Render-tier image preprocessing equals transformers' Qwen2-VL image processor bit for
bit, and bad images are refused with typed errors naming the limit."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from splitserve.frontend.image_processor import (
    ImageLimits,
    ImageProcessorConfig,
    ImageTooLargeError,
    InvalidImageError,
    decode_data_url,
    process_image_bytes,
    process_image_url,
)

# small max_pixels so that large images are downscaled while the test stays fast
CONFIG = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 48)


def photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Gradients, a disc and noise: compresses like a photo, exercises every channel."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [xx / width * 200 + 30, yy / height * 180 + 40, (xx + yy) / (width + height) * 150 + 60], -1
    )
    rgb[(xx - width / 2) ** 2 + (yy - height / 3) ** 2 < (min(width, height) / 4) ** 2] = [220, 180, 60]
    rgb = np.clip(rgb + rng.normal(0, 8, rgb.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgb)
    if mode == "RGBA":
        alpha = (xx * 255 // max(1, width - 1)).astype(np.uint8)
        image.putalpha(Image.fromarray(alpha))
    elif mode == "L":
        image = image.convert("L")
    elif mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        image.info["transparency"] = 3
    return image


def encode(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def reference_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=CONFIG.min_pixels, max_pixels=CONFIG.max_pixels)


CASES = [
    # (width, height, mode, format): upscaled to min_pixels, kept, downscaled to max_pixels
    (30, 20, "RGB", "PNG"),
    (200, 120, "RGB", "JPEG"),
    (301, 157, "RGB", "WEBP"),
    (640, 480, "RGB", "JPEG"),
    (97, 403, "L", "PNG"),
    (150, 90, "RGBA", "PNG"),
    (120, 80, "P", "PNG"),
]


@pytest.mark.parametrize(("width", "height", "mode", "image_format"), CASES)
def test_pixels_equal_transformers(reference_processor, width, height, mode, image_format):
    data = encode(photo(width, height, mode), image_format)
    ours = process_image_bytes(data, CONFIG)
    reference = reference_processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == reference["pixel_values"].shape
    assert np.array_equal(ours.pixel_values, reference["pixel_values"])  # bit for bit
    assert list(ours.grid_thw) == reference["image_grid_thw"][0].tolist()
    t, h, w = ours.grid_thw
    assert t == 1 and h % 2 == 0 and w % 2 == 0
    assert ours.num_visual_tokens == t * h * w // 4
    assert h * 14 * w * 14 <= CONFIG.max_pixels and h * 14 * w * 14 >= CONFIG.min_pixels


def test_data_url_and_hash():
    png = encode(photo(64, 48, seed=1), "PNG")
    from_url = process_image_url(data_url(png, "image/png"), CONFIG)
    assert np.array_equal(from_url.pixel_values, process_image_bytes(png, CONFIG).pixel_values)
    # the hash is of the decoded pixels: the same picture re-encoded hits, another one misses
    same_pixels = encode(photo(64, 48, seed=1), "PNG", compress_level=1)
    assert same_pixels != png
    assert process_image_bytes(same_pixels, CONFIG).image_hash == from_url.image_hash
    other = process_image_bytes(encode(photo(64, 48, seed=2), "PNG"), CONFIG)
    assert other.grid_thw == from_url.grid_thw and other.image_hash != from_url.image_hash
    # ... and of the preprocessing: other bounds would give other patches
    assert process_image_bytes(png, ImageProcessorConfig()).image_hash != from_url.image_hash
    assert len(from_url.image_hash) == 64


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming width × height, then one tiny IDAT: what a
    decompression bomb looks like before it is decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


def test_bad_images_raise_typed_errors():
    limits = ImageLimits()
    with pytest.raises(InvalidImageError, match="at least 14"):
        process_image_bytes(encode(Image.new("RGB", (1, 1)), "PNG"), CONFIG)
    with pytest.raises(ImageTooLargeError, match="max_source_pixels") as bomb:
        process_image_bytes(png_header_only(20_000, 20_000), CONFIG)
    assert bomb.value.status_code == 413
    with pytest.raises(InvalidImageError, match="cannot decode") as corrupt:
        process_image_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20, CONFIG)
    assert corrupt.value.status_code == 400
    truncated = encode(photo(200, 200), "JPEG")[:300]
    with pytest.raises(InvalidImageError, match="cannot decode"):
        process_image_bytes(truncated, CONFIG)
    with pytest.raises(InvalidImageError, match="cannot decode"):
        process_image_bytes(encode(photo(40, 40), "GIF"), CONFIG)  # not an allowed format
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        process_image_bytes(encode(Image.new("RGB", (3000, 14)), "PNG"), CONFIG)
    with pytest.raises(ImageTooLargeError, match="max_encoded_bytes"):
        process_image_bytes(encode(photo(64, 64), "PNG"), CONFIG, ImageLimits(max_encoded_bytes=100))
    with pytest.raises(ImageTooLargeError, match="max_decoded_bytes"):
        process_image_bytes(encode(photo(64, 64), "PNG"), CONFIG, ImageLimits(max_decoded_bytes=1000))
    png = encode(photo(32, 32), "PNG")
    with pytest.raises(InvalidImageError, match="not image/jpeg"):
        decode_data_url(data_url(png, "image/jpeg"), limits)  # the MIME type lies
    with pytest.raises(InvalidImageError, match="unsupported image type"):
        decode_data_url(data_url(png, "text/html"), limits)
    with pytest.raises(InvalidImageError, match="base64"):
        decode_data_url("data:image/png;base64,@@@@", limits)
    with pytest.raises(InvalidImageError, match="data: URL"):
        decode_data_url("https://example.com/cat.png", limits)
