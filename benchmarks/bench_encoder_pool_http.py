"""The encoder pool over HTTP: bytes per hop and latency of a repeated image, `up` without
and with `--encoder 1` (both `--prefill 1 --decode 1`, one CPU host).

Each stack gets `--requests` chat requests carrying the same `--images` fresh 448x448
pictures (a popular image: the first request is cold, the rest repeat it). Without an
encoder pool the proxy sends the processed pixels to prefill and to decode on every
request (the engines' own encoder caches spare only the vision tower); with one, the
pixels go to the encoder once and prefill/decode get hashes and placements only. Printed
per stack: cold and warm latency, bytes of image features per request to the engines, the
render tier's processed pixel bytes; last, the ratio of engine-hop bytes per request (with
pool / without).

    .venv/bin/python benchmarks/bench_encoder_pool_http.py [--requests 6 --images 2]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitserve.model.tiny import TinyModelSpec, write_tiny_model  # noqa: E402
from splitserve.model.tiny_vl import TinyVisionSpec  # noqa: E402
from splitserve.runtime.ports import pick_free_port as free_port  # noqa: E402


def picture_url(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray((rng.random((448, 448, 3)) * 255).astype(np.uint8)).save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def run_stack(model_dir: str, encoders: int, urls: list[str], requests: int) -> dict[str, float]:
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"bench-encoder-pool-{port}.log", "w+b")  # noqa: SIM115
    command = [sys.executable, "-m", "splitserve.cli", "up", model_dir, "--port", str(port)]
    command += [
        "--encoder",
        str(encoders),
        "--min-prefill-tokens",
        "16",
        "--pd-decision",
        "threshold",
        "--num-blocks",
        "512",
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"up did not start:\n{log.read().decode()[-3000:]}")
            time.sleep(0.5)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}],
            "max_tokens": 8,
            "temperature": 0,
        }
        latencies = []
        for _ in range(requests):
            start = time.perf_counter()
            response = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
        proxy = httpx.get(base + "/metrics").text
        log.seek(0)
        render_url = re.search(r"render\s+(http://\S+)", log.read().decode()).group(1)
        render = httpx.get(render_url + "/metrics").text
    finally:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
        log.close()
    pixel_bytes = counter(render, "splitserve_render_image_pixel_bytes_total")
    if encoders:
        engine_bytes = counter(proxy, 'splitserve_proxy_encoder_hop_bytes_total{hop="engines"}')
        encoder_bytes = counter(proxy, 'splitserve_proxy_encoder_hop_bytes_total{hop="encoder"}')
    else:  # the pixels as base64 in JSON, to prefill and to decode
        engine_bytes, encoder_bytes = 2 * pixel_bytes * 4 / 3, 0.0
    return {
        "cold_s": latencies[0],
        "warm_s": float(np.mean(latencies[1:])),
        "engine_bytes_per_request": engine_bytes / requests,
        "encoder_bytes": encoder_bytes,
        "pixel_bytes_per_request": pixel_bytes / requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--vision-dim", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "vl")
        vision = TinyVisionSpec(depth=args.vision_depth, embed_dim=args.vision_dim, heads=4, mlp_ratio=4)
        write_tiny_model(model_dir, TinyModelSpec(arch="qwen2_vl", hidden=128, heads=4, kv_heads=2), vision)
        urls = [picture_url(seed) for seed in range(args.images)]
        results = {}
        for encoders in (0, 1):
            results[encoders] = run_stack(model_dir, encoders, urls, args.requests)
    for encoders, result in results.items():
        name = "up --encoder 1" if encoders else "up (no encoder pool)"
        print(
            f"{name:<22} cold {result['cold_s'] * 1e3:7.0f} ms  warm {result['warm_s'] * 1e3:7.0f} ms  "
            f"render pixels/request {result['pixel_bytes_per_request'] / 2**20:6.2f} MiB  "
            f"to engines/request {result['engine_bytes_per_request'] / 2**10:9.1f} KiB  "
            f"to encoder (total) {result['encoder_bytes'] / 2**20:6.2f} MiB"
        )
    ratio = results[1]["engine_bytes_per_request"] / results[0]["engine_bytes_per_request"]
    print(f"\nratio (engine-hop bytes per request, with pool / without): {ratio:.2e}")


if __name__ == "__main__":
    main()
