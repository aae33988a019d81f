"""Images in the engine: per-request placements, the encoder cache, and each step's
M-RoPE positions and merged input embeddings for a vision-language model.

A request carries its images as `ImageInput`s (splitserve.protocol.multimodal: hash,
where its visual tokens sit in the prompt, grid, and the render tier's patches). The
vision tower runs when a step first needs an image's visual tokens; its output is kept in
the `EncoderCache` under the image hash, so a repeated image (in this request, a later
one, or a chunk after the first) is encoded once. The image hashes also enter the block
hashes of every block that covers visual tokens, so two images with the same placeholder
count never share prefix blocks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from splitserve.encoder_cache.connector import IMAGE_HASH_PATTERN, ECConnector
from splitserve.model.qwen2_vl import ImagePlacement, Qwen2VLConfig, Qwen2VLModel, mrope_positions
from splitserve.protocol.block_hash import MultiModalSpan
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.multimodal import ImageInput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MultiModalInputs:
    """A request's images and its M-RoPE positions (prompt, then index + delta)."""

    images: tuple[ImageInput, ...]
    lengths: tuple[int, ...]  # visual tokens of each image
    prompt_positions: torch.Tensor  # int64 [3, prompt length]
    delta: int

    @property
    def spans(self) -> tuple[MultiModalSpan, ...]:
        return tuple(
            MultiModalSpan(image.offset, length, image.image_hash)
            for image, length in zip(self.images, self.lengths, strict=True)
        )

    def positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start] of token indices [start, end)."""
        prompt_len = self.prompt_positions.shape[1]
        head = self.prompt_positions[:, start : min(end, prompt_len)]
        tail = torch.arange(max(start, prompt_len), max(end, prompt_len)) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)


def build_multimodal_inputs(
    prompt: Sequence[int],
    images: Sequence[ImageInput],
    config: Qwen2VLConfig,
    ec_connector: ECConnector | None = None,
) -> MultiModalInputs:
    """Check that the images and the prompt's image tokens agree, and that an image sent
    without pixels is in the encoder cache; raise InvalidRequestError."""
    merge = config.vision.spatial_merge_size
    if any(not isinstance(image, ImageInput) or not isinstance(image.offset, int) for image in images):
        raise InvalidRequestError("images must be ImageInputs with integer offsets", param="images")
    ordered = sorted(images, key=lambda image: image.offset)
    lengths, index = [], 0
    for image in ordered:
        if not IMAGE_HASH_PATTERN.match(str(image.image_hash)):
            raise InvalidRequestError(
                "each image needs an image_hash of 16 to 128 hex digits", param="images"
            )
        grid = image.grid_thw
        if (
            len(grid) != 3
            or any(not isinstance(g, int) or g <= 0 for g in grid)
            or grid[1] % merge
            or grid[2] % merge
        ):
            raise InvalidRequestError(
                f"image grid_thw {grid} must be 3 positive integers, height and width multiples of {merge}",
                param="images",
            )
        length = image.num_tokens(merge)
        if image.offset < index or image.offset + length > len(prompt):
            raise InvalidRequestError(
                f"image at offset {image.offset} ({length} tokens) overlaps another or leaves the prompt",
                param="images",
            )
        if any(token != config.image_token_id for token in prompt[image.offset : image.offset + length]):
            raise InvalidRequestError(
                f"prompt tokens [{image.offset}, {image.offset + length}) must all be the image token "
                f"{config.image_token_id}",
                param="images",
            )
        if image.pixel_values is None:
            if ec_connector is None or not ec_connector.has_cache(image.image_hash):
                raise InvalidRequestError(
                    f"image {image.image_hash[:16]}... has no pixels and is in no encoder cache",
                    param="images",
                )
        else:
            expected = (grid[0] * grid[1] * grid[2], config.vision.patch_input_size)
            if tuple(image.pixel_values.shape) != expected:
                raise InvalidRequestError(
                    f"image pixel_values shape {tuple(image.pixel_values.shape)}, expected {expected}",
                    param="images",
                )
        lengths.append(length)
        index = image.offset + length
    if sum(1 for token in prompt if token == config.image_token_id) != sum(lengths):
        raise InvalidRequestError("every image token of the prompt must belong to an image", param="images")
    placements = [ImagePlacement(image.offset, image.grid_thw) for image in ordered]
    positions, delta = mrope_positions(len(prompt), placements, merge)
    return MultiModalInputs(tuple(ordered), tuple(lengths), positions, delta)


class EncoderCache:
    """Visual-token embeddings by image hash, least recently used evicted past max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def get(self, image_hash: str) -> torch.Tensor | None:
        embeddings = self.entries.get(image_hash)
        if embeddings is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(image_hash)
        return embeddings

    def put(self, image_hash: str, embeddings: torch.Tensor) -> None:
        if image_hash in self.entries:
            return
        self.entries[image_hash] = embeddings
        self.num_bytes += embeddings.numel() * embeddings.element_size()
        while self.num_bytes > self.max_bytes and len(self.entries) > 1:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()


class MultiModalStats(NamedTuple):
    images_encoded: int  # by this engine's vision tower
    images_loaded: int  # from the encoder-cache connector (an encoder worker's output)
    encoder_cache_hits: int  # this engine's own cache
    encoder_cache_misses: int
    encode_seconds: float


class MultiModalRunner:
    """Builds a step's M-RoPE positions and input embeddings, encoding images on demand."""

    def __init__(
        self, model: Qwen2VLModel, cache: EncoderCache, ec_connector: ECConnector | None = None
    ) -> None:
        self.model = model
        self.cache = cache
        self.ec_connector = ec_connector
        self.num_images_encoded = 0  # by this engine's vision tower
        self.num_images_loaded = 0  # from the encoder-cache connector
        self.encode_seconds = 0.0

    def request_inputs(self, prompt: Sequence[int], images: Sequence[ImageInput]) -> MultiModalInputs | None:
        """A request's images checked against its prompt; None for a text-only prompt."""
        config = self.model.config
        if not images and config.image_token_id not in prompt:
            return None
        return build_multimodal_inputs(prompt, images, config, self.ec_connector)

    def step_inputs(
        self, ordered: Sequence[StepSlice], input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [3, T], inputs_embeds [T, hidden]) for the step's flattened tokens,
        laid out as `ordered` (the runner's order): text tokens embedded, visual tokens
        replaced by their image's embeddings."""
        position_parts: list[torch.Tensor] = []
        # (first row in the step, image, first and last visual token of it this step)
        overlaps: list[tuple[int, ImageInput, int, int]] = []
        row = 0
        for item in ordered:
            start, end = item.position_start, item.position_start + item.num_tokens
            inputs: MultiModalInputs | None = item.request.multimodal
            if inputs is None:
                position_parts.append(positions[row : row + item.num_tokens].expand(3, -1))
            else:
                position_parts.append(inputs.positions(start, end).to(positions.device))
                for image, length in zip(inputs.images, inputs.lengths, strict=True):
                    first, last = max(start, image.offset), min(end, image.offset + length)
                    if first < last:
                        overlaps.append(
                            (row + first - start, image, first - image.offset, last - image.offset)
                        )
            row += item.num_tokens
        inputs_embeds = self.model.embed_tokens(input_ids)
        if overlaps:
            embeddings = self._embeddings([image for _, image, _, _ in overlaps])
            for step_row, image, first, last in overlaps:
                inputs_embeds[step_row : step_row + last - first] = embeddings[image.image_hash][first:last]
        return torch.cat(position_parts, dim=1), inputs_embeds

    def _embeddings(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Every image's embeddings: from the cache, the missing ones encoded in one call."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageInput] = {}
        for image in images:
            if image.image_hash in found or image.image_hash in missing:
                continue
            cached = self.cache.get(image.image_hash)
            if cached is None and self.ec_connector is not None:
                cached = self._load(image)
            if cached is not None:
                found[image.image_hash] = cached
            elif image.pixel_values is None:
                raise RuntimeError(f"image {image.image_hash[:16]} is in no encoder cache and has no pixels")
            else:
                missing[image.image_hash] = image
        if missing:
            start = time.perf_counter()
            device = self.model.embed_tokens.weight.device
            pixels = torch.cat([torch.as_tensor(image.pixel_values) for image in missing.values()]).to(device)
            grids = [image.grid_thw for image in missing.values()]
            encoded = self.model.encode_images(pixels, grids)
            sizes = [t * h * w // self.model.config.vision.spatial_merge_size**2 for t, h, w in grids]
            for image_hash, embeddings in zip(missing, encoded.split(sizes), strict=True):
                self.cache.put(image_hash, embeddings)
                found[image_hash] = embeddings
                if self.ec_connector is not None:  # the next engine finds it
                    try:
                        self.ec_connector.save_cache(image_hash, embeddings)
                    except OSError as exc:  # publishing is best effort
                        logger.warning("cannot publish image %s: %s", image_hash[:16], exc)
            self.num_images_encoded += len(missing)
            self.encode_seconds += time.perf_counter() - start
        return found

    def _load(self, image: ImageInput) -> torch.Tensor | None:
        """The image's embeddings from the EC connector, if there and of the right shape."""
        assert self.ec_connector is not None
        embeddings = self.ec_connector.load_cache(image.image_hash, self.model.embed_tokens.weight.device)
        if embeddings is None:
            return None
        expected = (
            image.num_tokens(self.model.config.vision.spatial_merge_size),
            self.model.embed_tokens.embedding_dim,
        )
        if tuple(embeddings.shape) != expected:
            logger.warning(
                "encoder cache entry %s has shape %s, expected %s; ignoring it",
                image.image_hash[:16],
                tuple(embeddings.shape),
                expected,
            )
            return None
        self.cache.put(image.image_hash, embeddings)
        self.num_images_loaded += 1
        return embeddings

    def stats(self) -> MultiModalStats:
        return MultiModalStats(
            self.num_images_encoded,
            self.num_images_loaded,
            self.cache.hits,
            self.cache.misses,
            self.encode_seconds,
        )


class RequestWithImages(Protocol):
    @property
    def multimodal(self) -> MultiModalInputs | None: ...


class StepSlice(Protocol):
    """What `step_inputs` reads of the scheduler's ScheduledRequest; named by shape, not
    imported, so this module does not depend on the scheduler (which depends on kv)."""

    @property
    def request(self) -> RequestWithImages: ...

    @property
    def position_start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...
