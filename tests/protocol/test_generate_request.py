"""The typed generate request: its wire form both ways (ours and vLLM's render tier's),
the router's view (routing hints, null max_tokens, pixels left alone) and every refusal
with its message and `param`."""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pytest

from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import KVTransferParams
from splitserve.protocol.sampling_params import SamplingParams

# What splitserve's render tier sends (frontend/render.py), routing hint included.
RENDERED = {
    "request_id": "chatcmpl-1",
    "token_ids": [5, 6, 7, 8],
    "sampling_params": {
        "max_tokens": 20,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 7,
        "stop_token_ids": [5],
        "ignore_eos": False,
        "logprobs": None,
    },
    "block_hashes": ["ab" * 32],
    "features": None,
    "model": "tiny",
    "stream": True,
    "cache_salt": "salt",
    "stream_options": {"include_usage": True},
    "return_token_ids": True,
    "conversation_id": "conv-1",
}
# What `vllm launch render` (0.32) answered for a chat request (tests/engine/api/test_engine_api.py).
VLLM_RENDERED = json.loads(
    '{"request_id":"chatcmpl-ba1a291f1c2aa8fd","token_ids":[1,503,201,1069,560,2,201,1,476,201],'
    '"token_offsets":null,"features":null,"content_parts":null,"sampling_params":{"presence_penalty":0.0,'
    '"frequency_penalty":0.0,"repetition_penalty":1.0,"temperature":0.0,"stop":[],"stop_token_ids":[],'
    '"max_tokens":5,"output_kind":2,"skip_clone":true,"bad_words":[],"skip_reading_prefix_cache":false},'
    '"model":"/models/bench","reasoning_ended":null,"reasoning_parser_kwargs":null,"return_token_ids":null,'
    '"output_mode":"tokens","stream":false,"stream_options":null,"cache_salt":null,"priority":0,'
    '"kv_transfer_params":null,"ec_transfer_params":null}'
)


def features(pixels: np.ndarray | None) -> dict:
    data = None
    if pixels is not None:
        data = {
            "dtype": "float32",
            "shape": list(pixels.shape),
            "data": base64.b64encode(pixels.tobytes()).decode(),
        }
    return {
        "mm_hashes": {"image": ["img-1"]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 1}]},
        "kwargs_data": {"image": [{"grid_thw": [1, 2, 2], "pixel_values": data}]},
    }


def test_the_render_tiers_body_round_trips_exactly_through_the_router():
    request = GenerateRequest.from_wire(RENDERED, max_pixel_bytes=None, routing_hints=True)
    assert request.to_wire(routing_hints=True) == RENDERED
    assert request.token_ids == (5, 6, 7, 8) and request.conversation_id == "conv-1"
    assert request.sampling_params == SamplingParams(
        max_tokens=20, temperature=0.0, seed=7, stop_token_ids=(5,)
    )
    engine_body = request.to_wire()
    assert "conversation_id" not in engine_body and "prompt_text" not in engine_body
    assert GenerateRequest.from_wire(engine_body) == dataclasses.replace(request, conversation_id=None)


def test_vllms_render_output_is_read_and_written_without_its_neutral_extras():
    request = GenerateRequest.from_wire(VLLM_RENDERED, max_model_len=64)
    assert request.request_id == "chatcmpl-ba1a291f1c2aa8fd" and request.model == "/models/bench"
    assert request.sampling_params == SamplingParams(max_tokens=5, temperature=0.0)
    assert not request.stream and not request.include_usage and request.kv_transfer_params is None
    wire = request.to_wire()
    assert wire["token_ids"] == VLLM_RENDERED["token_ids"] and wire["model"] == "/models/bench"
    for dropped in ("priority", "output_mode", "token_offsets", "ec_transfer_params", "stream_options"):
        assert dropped not in wire
    assert "presence_penalty" not in wire["sampling_params"]
    assert GenerateRequest.from_wire(wire, max_model_len=64) == request


def test_edits_are_dataclass_replacements_and_kv_transfer_params_travel_typed():
    request = GenerateRequest.from_wire(RENDERED, max_pixel_bytes=None, routing_hints=True)
    kv = KVTransferParams(do_remote_decode=True, transfer_mode="pull")
    prefill = dataclasses.replace(
        request,
        request_id="chatcmpl-1-prefill",
        sampling_params=dataclasses.replace(request.sampling_params, max_tokens=1),
        kv_transfer_params=kv,
    )
    wire = prefill.to_wire()
    assert wire["kv_transfer_params"] == {"do_remote_decode": True, "transfer_mode": "pull"}
    assert wire["sampling_params"]["max_tokens"] == 1 and request.sampling_params.max_tokens == 20
    assert GenerateRequest.from_wire(wire).kv_transfer_params == kv


def test_a_null_max_tokens_stays_null_in_front_of_the_engine_and_is_resolved_at_its_edge():
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": None}}
    routed = GenerateRequest.from_wire(body, max_pixel_bytes=None)
    assert routed.sampling_params.max_tokens is None
    assert routed.to_wire()["sampling_params"]["max_tokens"] is None
    assert GenerateRequest.from_wire(routed.to_wire(), max_model_len=10).sampling_params.max_tokens == 7
    assert GenerateRequest.from_wire({"token_ids": [1]}, max_model_len=10).sampling_params.max_tokens == 16
    resumed = SamplingParams(max_tokens=None, preceding_output_tokens=4)
    assert resumed.to_wire()["preceding_output_tokens"] == 4
    assert "preceding_output_tokens" not in SamplingParams().to_wire()


def test_pixels_are_decoded_at_the_engine_and_passed_on_as_sent_by_the_router():
    pixels = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    body = {"token_ids": [1, 9, 2], "features": features(pixels)}
    routed = GenerateRequest.from_wire(body, max_pixel_bytes=None)
    assert routed.images == () and routed.to_wire()["features"] == body["features"]
    engine = GenerateRequest.from_wire(body)
    (image,) = engine.images
    assert image.image_hash == "img-1" and image.offset == 1 and image.grid_thw == (1, 2, 2)
    assert np.array_equal(image.pixel_values, pixels)
    assert engine.features == features(None)  # the pixels live in `images` only
    with pytest.raises(APIError) as info:
        GenerateRequest.from_wire(body, max_pixel_bytes=10)
    assert info.value.status == 413 and info.value.param == "features"


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ([1], "request body must be a JSON object", None),
        ({}, "token_ids is required", "token_ids"),
        ({"token_ids": []}, "token_ids must not be empty", "token_ids"),
        ({"token_ids": "1 2"}, "token_ids must be a list of integers", "token_ids"),
        ({"token_ids": [1, -5]}, "token_ids[1] is negative: -5", "token_ids"),
        ({"token_ids": [1, True]}, "token_ids[1] is not an integer: True", "token_ids"),
        ({"token_ids": [1], "prompt": "hi"}, "unknown field 'prompt'", "prompt"),
        ({"token_ids": [1], "conversation_id": "c"}, "unknown field 'conversation_id'", "conversation_id"),
        (
            {"token_ids": [1], "sampling_params": [0.5]},
            "sampling_params must be an object",
            "sampling_params",
        ),
        (
            {"token_ids": [1], "sampling_params": {"temprature": 0.5}},
            "sampling_params has unknown field(s): temprature",
            "sampling_params.temprature",
        ),
        (
            {"token_ids": [1], "sampling_params": {"top_p": 0}},
            "sampling_params.top_p must be a number in (0, 1] (got 0.0)",
            "sampling_params.top_p",
        ),
        (
            {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
            "sampling_params.max_tokens must be an integer >= 1 (got 0)",
            "sampling_params.max_tokens",
        ),
        (
            {"token_ids": [1], "sampling_params": {"n": 2}},
            "sampling_params.n=2 is not supported by this engine",
            "sampling_params.n",
        ),
        (
            {"token_ids": [1], "output_mode": "text"},
            "output_mode='text' is not supported by this engine",
            "output_mode",
        ),
        ({"token_ids": [1], "stream": "yes"}, "stream must be a boolean", "stream"),
        ({"token_ids": [1], "stream_options": []}, "stream_options must be an object", "stream_options"),
        (
            {"token_ids": [1], "stream_options": {"usage": True}},
            "unknown field 'stream_options.usage'",
            "stream_options.usage",
        ),
        (
            {"token_ids": [1], "stream_options": {"include_usage": 1}},
            "stream_options.include_usage must be a boolean",
            "stream_options.include_usage",
        ),
        (
            {"token_ids": [1], "cache_salt": ""},
            "cache_salt must be a non-empty string of at most 1024 characters",
            "cache_salt",
        ),
        (
            {"token_ids": [1], "request_id": 5},
            "request_id must be a non-empty string of at most 256 characters",
            "request_id",
        ),
        (
            {"token_ids": [1], "kv_transfer_params": [1]},
            "kv_transfer_params must be an object",
            "kv_transfer_params",
        ),
        (
            {"token_ids": [1], "kv_transfer_params": {"remote_port": "x"}},
            "kv_transfer_params.remote_port is not valid: x",
            "kv_transfer_params.remote_port",
        ),
        (
            {"token_ids": [1], "return_token_ids": "y"},
            "return_token_ids must be a boolean",
            "return_token_ids",
        ),
        (
            {"token_ids": [1], "features": {"mm_hashes": {}}},
            "features must hold mm_hashes.image and mm_placeholders.image lists",
            "features",
        ),
    ],
)
def test_every_refusal_names_its_field(body, message, param):
    with pytest.raises(APIError) as info:
        GenerateRequest.from_wire(body, max_model_len=64)
    assert (info.value.status, info.value.message, info.value.param) == (400, message, param)
