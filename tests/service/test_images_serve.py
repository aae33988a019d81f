"""`splitserve serve` on a Qwen2-VL model through the official openai client: chat with 1,
2 and 4 images gives transformers' greedy tokens; bad images are 400/413 naming the limit
and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import free_port, running_server
from tests.engine.vl_helpers import MAX_TOKENS
from tests.frontend.test_image_processor import png_header_only
from tests.frontend.test_render_images import data_url, png
from tests.service.image_requests import PICTURES, image_chat_body, oracle

FLAGS = ["--max-model-len", "1024", "--num-blocks", "256", "--max-images-per-request", "4"]


@pytest.fixture(scope="module")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


@pytest.fixture(scope="module")
def server(vl_model):
    port = free_port()
    with running_server(["serve", vl_model, "--port", str(port), *FLAGS], port, timeout=180) as base:
        yield base


def test_images_through_the_openai_client_equal_transformers(server, vl_model):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        requests = [PICTURES[:1], PICTURES[1:3], PICTURES]
        answers = []
        for pictures in requests:
            body = image_chat_body(model, pictures)
            extra = {k: body.pop(k) for k in ("ignore_eos", "return_token_ids")}
            answers.append(client.chat.completions.create(**body, extra_body=extra))
    prompts = [answer.model_extra["prompt_token_ids"] for answer in answers]
    got = [answer.choices[0].model_extra["token_ids"] for answer in answers]
    assert got == oracle(vl_model, list(zip(prompts, requests, strict=True)))
    assert answers[1].usage.prompt_tokens > answers[0].usage.prompt_tokens  # two images' tokens


def with_image_url(url: str) -> dict:
    body = image_chat_body("", [])
    body["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": url}})
    return body


def test_bad_images_are_refused_naming_the_limit_and_serving_goes_on(server):
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]

    def post(body: dict) -> httpx.Response:
        return httpx.post(server + "/v1/chat/completions", json={**body, "model": model}, timeout=60)

    too_many = post(image_chat_body(model, [*PICTURES, PICTURES[0]]))
    assert too_many.status_code == 400 and "max_images_per_request" in too_many.json()["error"]["message"]
    answer = post(with_image_url(data_url(png_header_only(20_000, 20_000))))  # a decompression bomb
    assert answer.status_code == 413 and "max_source_pixels" in answer.json()["error"]["message"]
    answer = post(with_image_url("data:image/png;base64,AAAA"))  # not an image
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert post(with_image_url(data_url(png(1, 1, 4)))).status_code == 400  # under min_side
    assert post(with_image_url("http://127.0.0.1/a.png")).status_code == 400  # no --allowed-media-domains

    fine = post(image_chat_body(model, PICTURES[:1]))
    assert fine.status_code == 200 and len(fine.json()["choices"][0]["token_ids"]) == MAX_TOKENS
