"""Images in a chat request, on the render tier: load, preprocess, expand placeholders.

The chat template puts one `<|image_pad|>` where each image goes; after tokenizing, each
becomes as many image tokens as the image has visual tokens (as transformers' processor
does), and the image's hash and placement travel with the token IDs. Image URLs are
`data:` URLs, `file://` URLs under the operator's `allowed_media_path`, or http(s) URLs
on the operator's `allowed_media_domains` (see media_fetch.py). Every refusal is a
InvalidRequestError: 400, or 413 for a size limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from splitserve.frontend.image_processor import (
    ImageError,
    ImageLimits,
    ImageProcessorConfig,
    decode_data_url,
    process_image_bytes,
)
from splitserve.frontend.media_fetch import FetchPolicy, fetch_image
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.multimodal import PIXEL_DTYPES, ImageInput


@dataclass(frozen=True)
class MediaConfig:
    allowed_media_path: str | None = None  # file:// URLs only below this directory
    allowed_media_domains: tuple[str, ...] = ()  # http(s) image hosts; none: remote URLs refused
    fetch_timeout_s: float = 10.0
    allow_private_media_addresses: bool = False  # image servers inside the deployment
    max_images_per_request: int = 8
    # processed pixels of one request, as sent on to the engine or the encoder pool
    max_pixel_bytes_per_request: int = 64 * 2**20
    pixel_dtype: str = "float32"  # "float16" halves the internal payload
    limits: ImageLimits = field(default_factory=ImageLimits)


@dataclass(frozen=True)
class VisionModel:
    """What the render tier needs of a vision-language model."""

    image_token_id: int
    processor: ImageProcessorConfig

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> VisionModel | None:
        """None for a model without a vision tower (or without config.json and
        preprocessor_config.json, as a GGUF file)."""
        config_path = Path(model_dir) / "config.json"
        preprocessor_path = Path(model_dir) / "preprocessor_config.json"
        if not config_path.is_file() or not preprocessor_path.is_file():
            return None
        config = json.loads(config_path.read_text())
        if "vision_config" not in config:
            return None
        return cls(int(config["image_token_id"]), ImageProcessorConfig.from_model_dir(model_dir))


def load_image_bytes(url: str, media: MediaConfig) -> bytes:
    """The encoded image a URL names: a data: URL, or a file under allowed_media_path."""
    if url.startswith("data:"):
        return decode_data_url(url, media.limits)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if media.allowed_media_path is None:
            raise InvalidRequestError(
                "file:// image URLs are disabled (no allowed media path)", param="messages"
            )
        root = Path(media.allowed_media_path).resolve()
        path = Path(unquote(parsed.path)).resolve()  # symlinks resolved: no escaping the root
        if not path.is_relative_to(root) or not path.is_file():
            raise InvalidRequestError(
                f"image file {url!r} is not a file under the allowed media path", param="messages"
            )
        if path.stat().st_size > media.limits.max_encoded_bytes:
            raise InvalidRequestError(
                f"image file is over max_encoded_bytes ({media.limits.max_encoded_bytes})",
                param="messages",
                status=413,
            )
        with open(path, "rb") as handle:
            return handle.read(media.limits.max_encoded_bytes + 1)
    if parsed.scheme in ("http", "https"):
        if not media.allowed_media_domains:
            raise InvalidRequestError("remote image URLs are not enabled; send a data: URL", param="messages")
        policy = FetchPolicy(
            tuple(domain.lower() for domain in media.allowed_media_domains),
            media.limits.max_encoded_bytes,
            media.fetch_timeout_s,
            media.allow_private_media_addresses,
        )
        return fetch_image(url, policy)
    raise InvalidRequestError(f"unsupported image URL scheme {parsed.scheme!r}", param="messages")


def render_images(
    token_ids: list[int], urls: list[str], vision: VisionModel, media: MediaConfig
) -> tuple[list[int], list[ImageInput]]:
    """Preprocess the images and expand each image token of the prompt (one per image, in
    order) into the image's visual tokens; returns the new token IDs and the images."""
    if len(urls) > media.max_images_per_request:
        raise InvalidRequestError(
            f"{len(urls)} images; max_images_per_request is {media.max_images_per_request}",
            param="messages",
        )
    positions = [i for i, token in enumerate(token_ids) if token == vision.image_token_id]
    if len(positions) != len(urls):
        raise InvalidRequestError(
            f"the prompt has {len(positions)} image placeholders for {len(urls)} images", param="messages"
        )
    itemsize = PIXEL_DTYPES[media.pixel_dtype]().itemsize
    expanded: list[int] = []
    images: list[ImageInput] = []
    pixel_bytes, start = 0, 0
    for index, (position, url) in enumerate(zip(positions, urls, strict=True)):
        try:
            processed = process_image_bytes(load_image_bytes(url, media), vision.processor, media.limits)
        except ImageError as exc:
            raise InvalidRequestError(
                f"image {index}: {exc}", param="messages", status=exc.status_code
            ) from exc
        except OSError as exc:
            raise InvalidRequestError(
                f"image {index}: cannot read it: {exc.strerror}", param="messages"
            ) from exc
        pixel_bytes += processed.pixel_values.size * itemsize
        if pixel_bytes > media.max_pixel_bytes_per_request:
            raise InvalidRequestError(
                f"the images' processed pixels are over max_pixel_bytes_per_request "
                f"({media.max_pixel_bytes_per_request} bytes)",
                param="messages",
                status=413,
            )
        expanded += token_ids[start:position]
        images.append(
            ImageInput(processed.image_hash, len(expanded), processed.grid_thw, processed.pixel_values)
        )
        expanded += [vision.image_token_id] * processed.num_visual_tokens
        start = position + 1
    expanded += token_ids[start:]
    return expanded, images
