"""Encoder disaggregation on the CPU: how much image work stalls text-only streams.

One engine serves `--streams` text-only requests (long outputs, greedy) while requests
with `--images-per-request` fresh images (never cached) arrive every `--interval-ms`.
  - collocated: the engine runs the vision tower inside its steps, as one process does;
  - EPD: an encoder worker in its own process (its own core: torch uses one thread per
    process here, standing in for a separate accelerator) encodes each image request into
    the shared-memory encoder cache first; the engine then gets the request with image
    hashes only and loads the embeddings.
For the text-only streams: the worst gap between two tokens and the p99 inter-token
latency. The encoder is sized (`--vision-*`) so that one image costs ~100s of ms. The
ratio (EPD worst gap / collocated worst gap; the aim is <= 0.3) is printed last.

    .venv/bin/python benchmarks/bench_encoder_interference.py [--streams 4 --image-requests 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.frontend.image_processor import ImageProcessorConfig, process_image  # noqa: E402
from splitserve.model.qwen2_vl import load_qwen2_vl_config  # noqa: E402
from splitserve.model.tiny import write_tiny_model  # noqa: E402
from splitserve.model.tiny_text import TinyModelSpec  # noqa: E402
from splitserve.model.tiny_vl import TinyVisionSpec  # noqa: E402
from splitserve.protocol.generate_request import GenerateRequest  # noqa: E402
from splitserve.protocol.multimodal import ImageInput  # noqa: E402
from splitserve.protocol.sampling_params import SamplingParams  # noqa: E402

TEXT = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
IMAGE_REPLY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def image_request(model_dir: str, seed: int, num_images: int) -> tuple[list[int], list[ImageInput]]:
    config = load_qwen2_vl_config(model_dir)
    processor = ImageProcessorConfig.from_model_dir(model_dir)
    rng = np.random.default_rng(seed)
    token_ids, images = [11, 12, 13], []
    for _ in range(num_images):
        picture = Image.fromarray((rng.random((448, 448, 3)) * 255).astype(np.uint8))
        processed = process_image(picture, processor)
        token_ids.append(config.vision_start_token_id)
        images.append(
            ImageInput(processed.image_hash, len(token_ids), processed.grid_thw, processed.pixel_values)
        )
        token_ids += [config.image_token_id] * processed.num_visual_tokens + [config.vision_end_token_id, 14]
    return token_ids, images


def encoder_process(model_dir: str, cache_dir: str, jobs: mp.Queue, done: mp.Queue) -> None:
    from splitserve.encoder_cache.connector import SharedMemoryECConnector
    from splitserve.engine.encoder_worker import EncoderJob, EncoderWorker

    torch.set_num_threads(1)
    worker = EncoderWorker(model_dir, SharedMemoryECConnector(cache_dir), dtype="float32", device="cpu")
    done.put("ready")
    while (item := jobs.get()) is not None:
        index, images = item
        worker.encode([EncoderJob(i.image_hash, i.grid_thw, i.pixel_values) for i in images])
        done.put(index)


def run(model_dir: str, args: argparse.Namespace, epd: bool) -> tuple[list[float], float]:
    """Inter-token gaps (s) of the text streams, and the image requests' mean latency."""
    from splitserve.encoder_cache.connector import SharedMemoryECConnector

    torch.set_num_threads(1)
    cache_dir = tempfile.mkdtemp(prefix="ec-bench-")
    llm = LLM(
        model_dir,
        num_blocks=4096,
        max_num_batched_tokens=2048,
        ec_connector=SharedMemoryECConnector(cache_dir),
    )
    engine = llm.engine
    requests = [
        image_request(model_dir, 1000 + i, args.images_per_request) for i in range(args.image_requests)
    ]
    spawn = mp.get_context("spawn")  # a fresh interpreter: no forked torch state
    jobs, done = spawn.Queue(), spawn.Queue()
    encoder = None
    if epd:
        encoder = spawn.Process(target=encoder_process, args=(model_dir, cache_dir, jobs, done))
        encoder.start()
        assert done.get(timeout=120) == "ready"
    for i in range(args.streams):
        engine.add_request(GenerateRequest(f"text-{i}", (20 + i, 30, 40, 50), TEXT))
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    sent = 0
    arrivals: dict[int, float] = {}
    latencies: list[float] = []
    start = time.monotonic()
    warmup_s = 0.5
    while len(latencies) < len(requests):
        now = time.monotonic()
        if sent < len(requests) and now - start >= warmup_s + sent * args.interval_ms / 1000:
            arrivals[sent] = now
            if epd:  # the proxy: encoder job first, the request once its images are cached
                jobs.put((sent, requests[sent][1]))
            else:
                engine.add_request(
                    GenerateRequest(
                        f"image-{sent}",
                        tuple(requests[sent][0]),
                        IMAGE_REPLY,
                        images=tuple(requests[sent][1]),
                    )
                )
            sent += 1
        while epd and not done.empty():
            index = done.get()
            token_ids, images = requests[index]
            hashes_only = [dataclasses.replace(i, pixel_values=None) for i in images]
            engine.add_request(
                GenerateRequest(f"image-{index}", tuple(token_ids), IMAGE_REPLY, images=tuple(hashes_only))
            )
        for out in engine.step():
            stamp = time.monotonic()
            if out.request_id.startswith("text-"):
                if out.request_id in last_token and stamp - start > warmup_s:
                    gaps.append(stamp - last_token[out.request_id])
                last_token[out.request_id] = stamp
            elif out.finished:
                latencies.append(stamp - arrivals[int(out.request_id.split("-")[1])])
    if encoder is not None:
        jobs.put(None)
        encoder.join(timeout=30)
    engine.abort_request([f"text-{i}" for i in range(args.streams)])
    return gaps, float(np.mean(latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--image-requests", type=int, default=6)
    parser.add_argument("--images-per-request", type=int, default=2)
    parser.add_argument("--interval-ms", type=float, default=1000)
    parser.add_argument("--vision-depth", type=int, default=8)
    parser.add_argument("--vision-dim", type=int, default=256)
    args = parser.parse_args()

    model_dir = tempfile.mkdtemp(prefix="vl-bench-")
    vision = TinyVisionSpec(depth=args.vision_depth, embed_dim=args.vision_dim, heads=4, mlp_ratio=4)
    write_tiny_model(model_dir, TinyModelSpec(arch="qwen2_vl", hidden=128, heads=4, kv_heads=2), vision)

    torch.set_num_threads(1)
    llm = LLM(model_dir, num_blocks=256)
    token_ids, images = image_request(model_dir, 7, 1)
    started = time.perf_counter()
    llm.generate([token_ids], IMAGE_REPLY, images=[images])
    total_ms = (time.perf_counter() - started) * 1e3
    encoder_ms = llm.engine.multimodal.encode_seconds * 1e3
    patches = images[0].grid_thw[1] * images[0].grid_thw[2]
    print(f"one image ({patches} patches) end to end: {total_ms:.0f} ms, the encoder {encoder_ms:.0f} ms")

    results = {}
    for name, epd in (("collocated", False), ("EPD", True)):
        gaps, image_latency = run(model_dir, args, epd)
        results[name] = max(gaps)
        print(
            f"{name:>10s}: text streams worst gap {max(gaps) * 1e3:7.1f} ms, p99 ITL "
            f"{np.percentile(gaps, 99) * 1e3:6.1f} ms, median {np.median(gaps) * 1e3:5.1f} ms; "
            f"image requests mean latency {image_latency * 1e3:6.0f} ms"
        )
    ratio = results["EPD"] / results["collocated"]
    print(f"\nratio (EPD worst gap / collocated worst gap): {ratio:.2f}  (aim <= 0.3)")


if __name__ == "__main__":
    main()
