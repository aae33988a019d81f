"""A proxy whose encoder worker is down still answers with transformers' greedy tokens:
the encoder call fails, the request goes on with its pixels and decode encodes the image
itself (slower, never lost)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import free_port, running_server, running_servers
from tests.service.image_requests import PICTURES, chat, counter, image_chat_body, oracle


@pytest.fixture(scope="module")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


def test_an_encoder_that_is_down_costs_time_not_the_request(vl_model):
    render_port, decode_port, proxy_port = free_port(), free_port(), free_port()
    dead_encoder = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    render = ["render", vl_model, "--port", str(render_port), "--max-model-len", "1024"]
    decode = ["engine", vl_model, "--role", "decode", "--port", str(decode_port), "--num-blocks", "256"]
    with running_servers([(render, render_port), (decode, decode_port)]) as (render_url, decode_url):
        proxy = ["proxy", "--port", str(proxy_port), "--render", render_url, "--decode", decode_url]
        with running_server([*proxy, "--encoder", dead_encoder], proxy_port) as base:
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            answer = chat(base, image_chat_body(model, PICTURES[:1]))
            proxy_metrics = httpx.get(base + "/metrics").text
        decode_metrics = httpx.get(decode_url + "/metrics").text
    expected = oracle(vl_model, [(answer["prompt_token_ids"], PICTURES[:1])])
    assert answer["choices"][0]["token_ids"] == expected[0]
    assert counter(proxy_metrics, "splitserve_proxy_encoder_failures") == 1
    assert counter(decode_metrics, "splitserve_images_encoded") == 1  # decode encoded it itself
