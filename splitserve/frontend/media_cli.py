"""The render tier's image flags (`render`, `serve`, `up`): where images may come from,
what one may cost, and the dtype of the pixels sent on. Each maps to a `MediaConfig` field."""

from __future__ import annotations

import argparse

from splitserve.frontend.image_processor import ImageLimits
from splitserve.frontend.images import MediaConfig
from splitserve.protocol.multimodal import PIXEL_DTYPES

# (flag, MediaConfig or ImageLimits field) of the numeric limits; `up` forwards them as given
MEDIA_LIMIT_FLAGS = (
    ("--max-images-per-request", "max_images_per_request"),
    ("--max-pixel-bytes-per-request", "max_pixel_bytes_per_request"),
    ("--max-image-encoded-bytes", "max_encoded_bytes"),
    ("--max-image-source-pixels", "max_source_pixels"),
    ("--max-image-decoded-bytes", "max_decoded_bytes"),
)


def _domains(text: str) -> tuple[str, ...]:
    return tuple(domain.strip().lower() for domain in text.split(",") if domain.strip())


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    media, limits = MediaConfig(), ImageLimits()
    parser.add_argument(
        "--allowed-media-path",
        default=None,
        help="serve file:// image URLs below this directory (default: file URLs refused)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        type=_domains,
        default=(),
        help="comma-separated hosts http(s) image URLs may name (default: remote URLs refused)",
    )
    parser.add_argument("--media-fetch-timeout", type=float, default=media.fetch_timeout_s)
    parser.add_argument(
        "--allow-private-media-addresses",
        action="store_true",
        help="let allowed media domains resolve to private addresses (image servers inside the deployment)",
    )
    defaults = {**vars(media), **vars(limits)}
    for flag, field_name in MEDIA_LIMIT_FLAGS:
        default = defaults[field_name]
        parser.add_argument(flag, type=int, default=default, help=f"default {default}")
    parser.add_argument(
        "--pixel-dtype",
        choices=sorted(PIXEL_DTYPES),
        default=media.pixel_dtype,
        help="processed pixels as sent on (float16 halves the payload, not bit-equal to transformers)",
    )


def media_config(args: argparse.Namespace) -> MediaConfig:
    limits = ImageLimits(
        max_encoded_bytes=args.max_image_encoded_bytes,
        max_source_pixels=args.max_image_source_pixels,
        max_decoded_bytes=args.max_image_decoded_bytes,
    )
    return MediaConfig(
        allowed_media_path=args.allowed_media_path,
        allowed_media_domains=args.allowed_media_domains,
        fetch_timeout_s=args.media_fetch_timeout,
        allow_private_media_addresses=args.allow_private_media_addresses,
        max_images_per_request=args.max_images_per_request,
        max_pixel_bytes_per_request=args.max_pixel_bytes_per_request,
        pixel_dtype=args.pixel_dtype,
        limits=limits,
    )


def media_flags(args: argparse.Namespace) -> list[str]:
    """The flags that give another process (`up` starting `render`) the same MediaConfig."""
    flags = [
        "--media-fetch-timeout", str(args.media_fetch_timeout), "--pixel-dtype", args.pixel_dtype,
    ]  # fmt: skip
    if args.allowed_media_path is not None:
        flags += ["--allowed-media-path", args.allowed_media_path]
    if args.allowed_media_domains:
        flags += ["--allowed-media-domains", ",".join(args.allowed_media_domains)]
    if args.allow_private_media_addresses:
        flags.append("--allow-private-media-addresses")
    for flag, _ in MEDIA_LIMIT_FLAGS:
        flags += [flag, str(getattr(args, flag.removeprefix("--").replace("-", "_")))]
    return flags
