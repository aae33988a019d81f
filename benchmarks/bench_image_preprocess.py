"""Render-tier image preprocessing: CPU per image, and the bytes each hop carries.

Same photo-like images (the seed's generator: gradients, shapes, a little noise), JPEG
encoded, at three sizes. Per image, best of `--repeats` (the machine is shared):
  - splitserve: `process_image_bytes` (decode, smart-resize, rescale, normalize, patchify,
    hash), what the render tier does per image;
  - the peer: transformers' Qwen2-VL image processor (PIL backend, what vLLM's render tier
    calls for Qwen2-VL) on the same bytes, decoded by PIL; it does not hash. (`vllm launch
    render` itself cannot load Qwen2-VL here: its model inspection imports torchvision,
    which does not install beside this torch; see PEERS.md.)
Both produce identical float32 patches (checked here). Then the seed's table of payload
per hop for its 1920x1080 photo: JPEG, processed pixels (float32 / float16, and as the
JSON features the render tier sends), the visual tokens' embeddings (bf16, hidden 3584)
and their KV cache (Qwen2.5-7B-sized), with the default Qwen2-VL preprocessing
(max_pixels 28*28*1280; the seed's table assumed a 644x644 grid instead).

    .venv/bin/python benchmarks/bench_image_preprocess.py [--repeats 5]

The ratio (peer time / splitserve time) per size is printed last.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitserve.frontend.image_processor import ImageProcessorConfig, process_image_bytes  # noqa: E402
from splitserve.protocol.multimodal import ImageInput, features_to_wire  # noqa: E402

MiB = 2**20
SIZES = [(640, 640), (1280, 720), (1920, 1080)]


def photo_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    yy, xx = np.mgrid[0:height, 0:width]
    image = np.stack(
        [xx / width * 200 + 30, yy / height * 180 + 40, (xx + yy) / (width + height) * 150 + 60], axis=-1
    )
    image[(xx - width * 0.68) ** 2 + (yy - height * 0.46) ** 2 < (height * 0.2) ** 2] = [220, 180, 60]
    image[height // 5 : height * 5 // 9, width // 6 : width * 3 // 8] = [70, 120, 200]
    noisy = image + np.random.default_rng(seed).normal(0, 6, image.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = ImageProcessorConfig()  # Qwen2-VL's defaults
    peer = Qwen2VLImageProcessorPil(min_pixels=config.min_pixels, max_pixels=config.max_pixels)

    def peer_process(data: bytes) -> np.ndarray:
        image = Image.open(io.BytesIO(data))
        return peer(images=[image], return_tensors="np")["pixel_values"]

    print(f"{'image':>10s} {'JPEG':>9s} {'grid':>10s} {'splitserve':>11s} {'transformers':>13s}")
    ratios = []
    for width, height in SIZES:
        data = photo_jpeg(width, height)
        ours = process_image_bytes(data, config)
        assert np.array_equal(ours.pixel_values, peer_process(data)), "pixels differ from transformers"
        ours_s = best_seconds(lambda d=data: process_image_bytes(d, config), args.repeats)
        peer_s = best_seconds(lambda d=data: peer_process(d), args.repeats)
        ratios.append((f"{width}x{height}", peer_s / ours_s))
        t, h, w = ours.grid_thw
        print(
            f"{width:>5d}x{height:<4d} {len(data) / 1024:7.0f} KiB {t}x{h}x{w:<6d} "
            f"{ours_s * 1e3:8.1f} ms {peer_s * 1e3:10.1f} ms"
        )

    # The seed's hop table, for its 1080p photo through the default preprocessing.
    data = photo_jpeg(1920, 1080)
    processed = process_image_bytes(data, config)
    image = ImageInput(processed.image_hash, 0, processed.grid_thw, processed.pixel_values)
    tokens = processed.num_visual_tokens
    rows = [
        ("source JPEG (what the client uploads)", len(data)),
        ("processed pixels, float32 (render -> encoder)", processed.pixel_values.nbytes),
        ("processed pixels, float16 (render -> encoder)", processed.pixel_values.nbytes // 2),
        ("  as JSON features, float32 (base64)", len(str(features_to_wire([image], 2)))),
        (f"embeddings, {tokens} visual tokens, bf16 (encoder -> prefill)", tokens * 3584 * 2),
        ("KV cache for those tokens (prefill -> decode)", tokens * 2 * 28 * 4 * 128 * 2),
    ]
    print(f"\n{'hop payload (1920x1080 photo)':60s} {'size':>10s} {'x JPEG':>7s}")
    for name, size in rows:
        print(f"{name:60s} {size / MiB:6.2f} MiB {size / len(data):6.0f}x")

    print("\nratio (transformers time / splitserve time, per image):")
    for name, ratio in ratios:
        print(f"  {name:>10s}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
