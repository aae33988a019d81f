"""Encoder disaggregation over HTTP: `splitserve up --encoder 1 --prefill 1 --decode 1` on
the tiny Qwen2-VL gives transformers' greedy tokens with 1 and 2 images and for text; each
distinct image is encoded once, by the encoder worker (prefill/decode load it by hash);
text-only requests never reach the encoder."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, running_server
from tests.frontend.test_render_images import png
from tests.service.image_requests import PICTURES, chat, counter, image_chat_body, oracle

FRESH = png(70, 98, 5)
FLAGS = [
    "--num-blocks",
    "256",
    "--max-model-len",
    "1024",
    "--min-prefill-tokens",
    "16",
    "--pd-decision",
    "threshold",
]


@pytest.fixture(scope="module")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


def part_urls(port: int) -> dict[str, str]:
    """The parts `up` printed (name -> URL), from the server's log."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-test-{port}.log"
    return dict(re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid", log.read_text(), re.MULTILINE))


def test_up_with_an_encoder_pool_equals_transformers_and_encodes_each_image_once(vl_model):
    port = free_port()
    command = ["up", vl_model, "--port", str(port), "--encoder", "1", "--prefill", "1", "--decode", "1"]
    token = {"SPLITSERVE_INTERNAL_TOKEN": "encoder-pool-test"}  # to read the parts' own metrics
    auth = {"Authorization": "Bearer encoder-pool-test"}
    with running_server([*command, *FLAGS], port, timeout=240, env=token) as base:
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        requests = [PICTURES[:1], PICTURES[1:3], PICTURES[:1], []]  # the first image again, then text
        answers = [chat(base, image_chat_body(model, pictures)) for pictures in requests]
        # two choices of one request with a new image: both wait for one encoder job
        twice = chat(base, {**image_chat_body(model, [FRESH]), "n": 2})
        proxy_metrics = httpx.get(base + "/metrics").text
        parts = part_urls(port)
        engines = {
            name: httpx.get(parts[name] + "/metrics", headers=auth).text for name in ("prefill-0", "decode-0")
        }
        encoder = httpx.get(parts["encoder-0"] + "/metrics", headers=auth).text
        render = httpx.get(parts["render"] + "/metrics", headers=auth).text

    prompts = [answer["prompt_token_ids"] for answer in [*answers, twice]]
    expected = oracle(vl_model, list(zip(prompts, [*requests, [FRESH]], strict=True)))
    assert [answer["choices"][0]["token_ids"] for answer in answers] == expected[:-1]
    assert [choice["token_ids"] for choice in twice["choices"]] == [expected[-1]] * 2

    # four distinct images: four encoder jobs; the repeat and the second choice are
    # skipped; text never counts
    assert counter(proxy_metrics, "splitserve_proxy_encoder_images_sent") == 4
    assert counter(proxy_metrics, "splitserve_proxy_encoder_images_skipped") == 2
    assert counter(proxy_metrics, "splitserve_proxy_encoder_failures") == 0
    assert counter(encoder, "splitserve_images_encoded") == 4
    for text in engines.values():  # prefill/decode never ran their vision tower
        assert counter(text, "splitserve_images_encoded") == 0
    assert counter(engines["prefill-0"], "splitserve_images_loaded") == 4
    assert counter(render, "splitserve_render_images_preprocessed") == 5
