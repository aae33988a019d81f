"""Qwen2-VL image preprocessing for the render tier: bytes → patches, grid and hash.

Torch-free (numpy + Pillow) so it runs on CPU-only hosts. The pixel values equal
transformers' Qwen2-VL image processor (its PIL backend) bit for bit in float32: the same
RGB conversion (alpha composited onto white), the same Pillow bicubic resize on uint8, the
rescale in float64 then float32, the normalization in float32 and the same patch order
(merge blocks of 2×2 patches contiguous, each patch duplicated along a time axis of 2).

Everything a client can send is checked before the expensive step it would abuse: the
encoded size before decoding, the header's width × height before the pixels are
decompressed (a 20,000 × 20,000 PNG of one colour is a few kilobytes), and the aspect
ratio and minimum side before resizing. Refusals are typed: `ImageTooLargeError` (HTTP 413)
and `InvalidImageError` (HTTP 400), each naming the limit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Formats a client may send, by Pillow's name and by MIME type in data: URLs.
ALLOWED_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_HASH_DOMAIN = b"splitserve-image-v1"


class ImageError(ValueError):
    """A client's image was refused; `status_code` is the HTTP status to answer."""

    status_code = 400


class InvalidImageError(ImageError):
    """Not a decodable JPEG/PNG/WebP, a wrong MIME type, or a shape the model cannot take."""


class ImageTooLargeError(ImageError):
    """Over a size limit (encoded bytes, source pixels, decoded bytes)."""

    status_code = 413


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The model's preprocessing, as in its preprocessor_config.json."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def resize_factor(self) -> int:
        """Each resized side is a multiple of this: one merged visual token's pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        raw = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        size = raw.get("size") or {}
        defaults = cls()
        return cls(
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels),
            patch_size=int(raw.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", defaults.merge_size)),
            image_mean=tuple(raw.get("image_mean", defaults.image_mean)),  # type: ignore[arg-type]
            image_std=tuple(raw.get("image_std", defaults.image_std)),  # type: ignore[arg-type]
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
        )


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost the render tier before it is refused."""

    max_encoded_bytes: int = 20 * 2**20  # the compressed file
    max_source_pixels: int = 50_000_000  # width × height in the header (a 48 MP photo passes)
    max_decoded_bytes: int = 200 * 2**20  # width × height × bytes per pixel once decompressed
    min_side: int = 14  # narrower than one patch is not a picture
    max_aspect_ratio: float = 200.0  # as transformers: the resize cannot keep a thinner one


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # float32 [grid_t * grid_h * grid_w, C * temporal * patch * patch]
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    image_hash: str  # hex blake2b of the decoded pixels and the preprocessing config
    merge_size: int

    @property
    def num_visual_tokens(self) -> int:
        """Placeholder tokens in the prompt: one per merge_size × merge_size patches."""
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size**2)


def smart_resize(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """The resized (height, width): multiples of `resize_factor`, pixels within
    [min_pixels, max_pixels], aspect ratio kept as closely as possible (as transformers)."""
    factor = config.resize_factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_data_url(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes of a `data:image/<type>;base64,<payload>` URL (JPEG, PNG or WebP)."""
    header, sep, payload = url.partition(",")
    if not header.startswith("data:") or not sep:
        raise InvalidImageError("an image URL must be a data: URL (data:image/png;base64,...)")
    mime, _, encoding = header[5:].partition(";")
    if mime.lower() not in ALLOWED_FORMATS.values():
        raise InvalidImageError(
            f"unsupported image type {mime!r}; allowed: {', '.join(sorted(ALLOWED_FORMATS.values()))}"
        )
    if encoding.lower() != "base64":
        raise InvalidImageError("an image data: URL must be base64-encoded (;base64,)")
    # base64 is 4 characters per 3 bytes: refuse before decoding what would be too big
    if len(payload) * 3 // 4 > limits.max_encoded_bytes:
        raise ImageTooLargeError(f"image is over max_encoded_bytes ({limits.max_encoded_bytes} bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidImageError(f"image data: URL is not valid base64: {exc}") from exc
    image_format = sniff_format(data)
    if ALLOWED_FORMATS.get(image_format or "") != mime.lower():
        raise InvalidImageError(f"image data is {image_format or 'not a known image format'}, not {mime}")
    return data


def sniff_format(data: bytes) -> str | None:
    """The Pillow format name of JPEG/PNG/WebP bytes, from their magic numbers."""
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes into an RGB image, refusing what breaks a limit."""
    if len(data) > limits.max_encoded_bytes:
        raise ImageTooLargeError(
            f"image is {len(data)} bytes, over max_encoded_bytes ({limits.max_encoded_bytes})"
        )
    try:
        with warnings.catch_warnings():
            # our own limits are tighter than Pillow's bomb warning; never let it print
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))
            _check_header(image, limits)
            image.load()
            image = ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        # Pillow's own guard fires in open() for headers far past any sane size
        raise ImageTooLargeError(
            f"image is over max_source_pixels ({limits.max_source_pixels}): {exc}"
        ) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's errors for corrupt data
        raise InvalidImageError(f"cannot decode image (JPEG, PNG or WebP expected): {exc}") from exc
    return to_rgb(image)


def _check_header(image: Image.Image, limits: ImageLimits) -> None:
    width, height = image.size
    if width * height > limits.max_source_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} pixels, over max_source_pixels ({limits.max_source_pixels})"
        )
    bytes_per_pixel = max(1, len(image.getbands())) * (2 if image.mode.startswith("I;16") else 1)
    if width * height * bytes_per_pixel > limits.max_decoded_bytes:
        raise ImageTooLargeError(
            f"image decodes to {width * height * bytes_per_pixel} bytes, over max_decoded_bytes "
            f"({limits.max_decoded_bytes})"
        )
    if min(width, height) < limits.min_side:
        raise InvalidImageError(
            f"image is {width}x{height} pixels; each side must be at least {limits.min_side} (min_side)"
        )
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise InvalidImageError(
            f"image is {width}x{height} pixels; the aspect ratio must be at most {limits.max_aspect_ratio:g}"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers converts it: transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def image_hash(image: Image.Image, config: ImageProcessorConfig) -> str:
    """A cryptographic hash of the decoded RGB pixels and the preprocessing config: equal
    hashes mean equal patches, so the hash can key the encoder cache and the prefix cache."""
    h = hashlib.blake2b(digest_size=32)
    h.update(_HASH_DOMAIN)
    h.update(json.dumps(asdict(config), sort_keys=True).encode())
    h.update(f"{image.mode}:{image.width}x{image.height}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def process_image(
    image: Image.Image,
    config: ImageProcessorConfig = ImageProcessorConfig(),
    limits: ImageLimits = ImageLimits(),
) -> ProcessedImage:
    """Resize, rescale, normalize and patchify one image (any Pillow image)."""
    _check_header(image, limits)
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, config)
    resized = np.asarray(rgb.resize((width, height), resample=Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    scaled = (resized.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.array(config.image_mean, dtype=np.float32)
    std = np.array(config.image_std, dtype=np.float32)
    normalized = ((scaled - mean) / std).transpose(2, 0, 1)  # [3, H, W]
    pixel_values, grid_h, grid_w = patchify(normalized, config)
    return ProcessedImage(pixel_values, (1, grid_h, grid_w), image_hash(rgb, config), config.merge_size)


def patchify(image: np.ndarray, config: ImageProcessorConfig) -> tuple[np.ndarray, int, int]:
    """[C, H, W] → [grid_h * grid_w, C * temporal * patch * patch], the patches of each
    merge_size × merge_size block contiguous, each patch repeated along time."""
    patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
    channels, height, width = image.shape
    grid_h, grid_w = height // patch, width // patch
    blocks = image.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh, gw, mh, mw, C, ph, pw]
    repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, patch, patch))
    flat = repeated.reshape(grid_h * grid_w, channels * temporal * patch * patch)
    return np.ascontiguousarray(flat, dtype=np.float32), grid_h, grid_w


def process_image_bytes(
    data: bytes, config: ImageProcessorConfig = ImageProcessorConfig(), limits: ImageLimits = ImageLimits()
) -> ProcessedImage:
    """Decode (JPEG/PNG/WebP) and process one image."""
    return process_image(decode_image(data, limits), config, limits)


def process_image_url(
    url: str, config: ImageProcessorConfig = ImageProcessorConfig(), limits: ImageLimits = ImageLimits()
) -> ProcessedImage:
    """Decode and process the image of a data: URL."""
    return process_image_bytes(decode_data_url(url, limits), config, limits)
