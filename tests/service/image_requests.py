"""Chat requests with images over HTTP, and transformers' greedy tokens for them (the
oracle: its own Qwen2-VL and image processor on the prompt token IDs a server returned)."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import httpx
from PIL import Image

from tests.engine.vl_helpers import MAX_TOKENS, transformers_greedy
from tests.frontend.test_render_images import data_url, png

# four pictures of different sizes (and so different visual-token counts)
PICTURES = [png(90, 130, 1), png(200, 120, 2), png(56, 84, 3), png(150, 60, 4)]


def image_chat_body(model: str, pictures: list[bytes], text: str = "Describe.") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in pictures]
    return {
        "model": model,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def oracle(model_dir: str, requests: list[tuple[list[int], list[bytes]]]) -> list[list[int]]:
    """transformers' greedy tokens for each (prompt token IDs, pictures)."""
    cases = [
        SimpleNamespace(token_ids=ids, pictures=[Image.open(io.BytesIO(p)).convert("RGB") for p in pictures])
        for ids, pictures in requests
    ]
    return transformers_greedy(model_dir, cases)


def chat(base: str, body: dict) -> dict:
    response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def counter(metrics_text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", metrics_text, re.MULTILINE)
    assert match, f"{name} not in metrics"
    return float(match.group(1))
