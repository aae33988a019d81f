"""The encoder role: a worker that runs only the vision tower.

It takes images (hash, grid, the render tier's patches), skips those the encoder-cache
connector already holds, encodes the rest in one batched call and publishes their
embeddings through the connector, where prefill/decode engines load them by hash. The
language model's weights are never read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.engine.device import choose_dtype
from splitserve.encoder_cache.connector import IMAGE_HASH_PATTERN, ECConnector
from splitserve.model.qwen2_vl import load_qwen2_vl_config, load_vision_tower
from splitserve.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class EncoderJob:
    image_hash: str
    grid_thw: tuple[int, int, int]
    pixel_values: np.ndarray | torch.Tensor  # float [t*h*w, channels*temporal*patch*patch]


@dataclass(frozen=True)
class EncodedImage:
    image_hash: str
    num_tokens: int
    cached: bool  # already in the encoder cache: not encoded again


class EncoderWorker:
    def __init__(
        self, model_dir: str, ec_connector: ECConnector, dtype: str | None = None, device: str | None = None
    ) -> None:
        self.config = load_qwen2_vl_config(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = choose_dtype(dtype, self.config.text.dtype, self.device)
        self.tower = load_vision_tower(model_dir, self.config, self.dtype, self.device)
        self.ec_connector = ec_connector
        self.num_images_encoded = 0
        self.num_cache_hits = 0
        self.encode_seconds = 0.0

    def validate(self, jobs: list[EncoderJob]) -> None:
        """Raise InvalidRequestError for a job the tower cannot take."""
        merge, patch_size = self.config.vision.spatial_merge_size, self.config.vision.patch_input_size
        for job in jobs:
            if not IMAGE_HASH_PATTERN.match(str(job.image_hash)):
                raise InvalidRequestError("an image_hash is 16 to 128 hex digits", param="image_hash")
            t, h, w = job.grid_thw
            if min(t, h, w) <= 0 or h % merge or w % merge:
                raise InvalidRequestError(
                    f"grid_thw {job.grid_thw} is not a {merge}x{merge} grid", param="grid_thw"
                )
            if tuple(job.pixel_values.shape) != (t * h * w, patch_size):
                raise InvalidRequestError(
                    f"pixel_values shape {tuple(job.pixel_values.shape)}, expected {(t * h * w, patch_size)}",
                    param="pixel_values",
                )

    @torch.inference_mode()
    def encode(self, jobs: list[EncoderJob]) -> list[EncodedImage]:
        """Encode what the cache lacks (each distinct hash once) and publish it."""
        self.validate(jobs)
        merge = self.config.vision.spatial_merge_size
        todo: dict[str, EncoderJob] = {}
        results = []
        for job in jobs:
            t, h, w = job.grid_thw
            cached = job.image_hash in todo or self.ec_connector.has_cache(job.image_hash)
            if cached:
                self.num_cache_hits += 1
            else:
                todo[job.image_hash] = job
            results.append(EncodedImage(job.image_hash, t * h * w // merge**2, cached))
        if todo:
            start = time.perf_counter()
            pixels = torch.cat([torch.as_tensor(job.pixel_values) for job in todo.values()]).to(self.device)
            grids = [job.grid_thw for job in todo.values()]
            embeddings = self.tower(pixels, grids)
            sizes = [t * h * w // merge**2 for t, h, w in grids]
            for image_hash, image_embeddings in zip(todo, embeddings.split(sizes), strict=True):
                self.ec_connector.save_cache(image_hash, image_embeddings)
            self.num_images_encoded += len(todo)
            self.encode_seconds += time.perf_counter() - start
        return results
