"""The images of a generate request on the wire: the `features` object (torch-free).

The render tier sends, per image, its hash, where its visual tokens sit in the prompt
and its processed patches; an encoder worker needs only hash, grid and patches; a
prefill/decode worker behind an encoder pool gets hashes and placements only
(`pixel_values` null) and loads the embeddings by hash. Shapes follow vLLM's render
features, one list per modality (only "image" here):

    {"mm_hashes": {"image": [hash, ...]},
     "mm_placeholders": {"image": [{"offset": int, "length": int}, ...]},
     "kwargs_data": {"image": [{"grid_thw": [t, h, w],
                                "pixel_values": {"dtype": "float32" | "float16",
                                                 "shape": [n, d], "data": base64} | null}, ...]}}

Processed pixels are ~35x the JPEG, so decoding takes an explicit byte limit; float16
halves the payload (at the cost of bit-equality with transformers' float32 pixels).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

PIXEL_DTYPES = {"float32": np.float32, "float16": np.float16}


class FeaturesError(ValueError):
    """Malformed features (HTTP 400), or `too_large` (HTTP 413) past the byte limit."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt."""

    image_hash: str
    offset: int  # prompt index of its first visual (<|image_pad|>) token
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    # [t*h*w, channels*temporal*patch*patch] float (numpy, or a torch tensor inside an
    # engine); None when the embeddings come from the encoder cache
    pixel_values: Any = None

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge * merge)


def features_to_wire(images: list[ImageInput], merge: int, pixel_dtype: str = "float32") -> dict[str, Any]:
    """The `features` object; images without pixels get `pixel_values: null`."""
    if pixel_dtype not in PIXEL_DTYPES:
        raise ValueError(f"pixel_dtype must be one of {sorted(PIXEL_DTYPES)}")
    kwargs = []
    for image in images:
        pixels = None
        if image.pixel_values is not None:
            array = np.ascontiguousarray(np.asarray(image.pixel_values, dtype=PIXEL_DTYPES[pixel_dtype]))
            pixels = {
                "dtype": pixel_dtype,
                "shape": list(array.shape),
                "data": base64.b64encode(array.tobytes()).decode(),
            }
        kwargs.append({"grid_thw": list(image.grid_thw), "pixel_values": pixels})
    return {
        "mm_hashes": {"image": [image.image_hash for image in images]},
        "mm_placeholders": {
            "image": [{"offset": image.offset, "length": image.num_tokens(merge)} for image in images]
        },
        "kwargs_data": {"image": kwargs},
    }


def features_from_wire(features: Any, max_pixel_bytes: int) -> list[ImageInput]:
    """The images of a `features` object; raises FeaturesError. `max_pixel_bytes` bounds
    the decoded pixels of the whole message."""
    if features is None:
        return []
    try:
        hashes = features["mm_hashes"]["image"]
        placeholders = features["mm_placeholders"]["image"]
        kwargs = (features.get("kwargs_data") or {}).get("image") or [{}] * len(hashes)
    except (KeyError, TypeError, AttributeError) as exc:
        raise FeaturesError("features must hold mm_hashes.image and mm_placeholders.image lists") from exc
    if not (isinstance(hashes, list) and isinstance(placeholders, list) and isinstance(kwargs, list)):
        raise FeaturesError("features' image entries must be lists")
    if not len(hashes) == len(placeholders) == len(kwargs):
        raise FeaturesError("features' image lists differ in length")
    images, total_bytes = [], 0
    for image_hash, placeholder, item in zip(hashes, placeholders, kwargs, strict=True):
        try:
            offset = int(placeholder["offset"])
            grid = tuple(int(n) for n in item["grid_thw"]) if item.get("grid_thw") is not None else None
            encoded = item.get("pixel_values")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FeaturesError(f"malformed image feature: {exc}") from exc
        if not isinstance(image_hash, str) or grid is None or len(grid) != 3:
            raise FeaturesError("each image needs a hash string and a grid_thw of 3 integers")
        pixels = None
        if encoded is not None:
            pixels, size = _decode_pixels(encoded, max_pixel_bytes - total_bytes)
            total_bytes += size
        images.append(ImageInput(image_hash, offset, grid, pixels))  # type: ignore[arg-type]
    return images


def _decode_pixels(encoded: Any, budget: int) -> tuple[np.ndarray, int]:
    try:
        dtype = PIXEL_DTYPES[encoded["dtype"]]
        shape = tuple(int(n) for n in encoded["shape"])
        data = encoded["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise FeaturesError(f"pixel_values need dtype (float32|float16), shape and data: {exc}") from exc
    if len(shape) != 2 or min(shape) <= 0:
        raise FeaturesError(f"pixel_values shape {list(shape)} is not [patches, patch size]")
    size = shape[0] * shape[1] * np.dtype(dtype).itemsize
    if size > budget:
        raise FeaturesError(
            f"image pixels are over the message's max_pixel_bytes ({budget} bytes left)", True
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise FeaturesError(f"pixel_values data is not base64: {exc}") from exc
    if len(raw) != size:
        raise FeaturesError(f"pixel_values data has {len(raw)} bytes; shape and dtype say {size}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(np.float32), size


def features_without_pixels(features: dict[str, Any]) -> dict[str, Any]:
    """What a prefill/decode worker behind an encoder pool gets: hashes, placements and
    grids, every `pixel_values` null (the proxy sends the pixels to the encoder only)."""
    kwargs = (features.get("kwargs_data") or {}).get("image") or []
    return {
        **features,
        "kwargs_data": {"image": [{**item, "pixel_values": None} for item in kwargs]},
    }
