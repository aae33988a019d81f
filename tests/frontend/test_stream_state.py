"""The signed streaming derender state: round trip, tamper/foreign refusal, flat size."""

from __future__ import annotations

import pytest

from splitserve.frontend.derender import Derenderer
from splitserve.frontend.render import RenderConfig, Renderer
from splitserve.frontend.stream_state import StreamStateCodec, StreamStateError, resolve_state_key
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.openai_api import ChatCompletionRequest

KEY = b"test-key-0123456789"


def test_round_trip_and_refusals():
    codec = StreamStateCodec(KEY)
    state = {"rid": "r", "ch": {"0": {"n": 3, "text": "東京"}}}
    token = codec.encode(state)
    assert codec.decode(token) == state
    version, payload, mac = token.split(".")
    flipped = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
    for bad in (
        f"{version}.{flipped}.{mac}",
        f"{version}.{payload}.{mac[:-1]}",
        "s2." + payload + "." + mac,
        "garbage",
        "",
        "a.b.c.d",
        "s1.!!!." + mac,
    ):
        with pytest.raises(StreamStateError):
            codec.decode(bad)
    with pytest.raises(StreamStateError, match="different --state-key"):
        StreamStateCodec(b"another-key-987654").decode(token)
    with pytest.raises(ValueError):
        StreamStateCodec(b"short")


def test_state_key_resolution(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_STATE_KEY", raising=False)
    assert resolve_state_key("explicit-key") == (b"explicit-key", True)
    key_a, shared = resolve_state_key(None)
    assert not shared and key_a != resolve_state_key(None)[0]  # random per process: not for replicas
    monkeypatch.setenv("SPLITSERVE_STATE_KEY", "from-env-key")
    assert resolve_state_key(None) == (b"from-env-key", True)


@pytest.fixture(scope="module")
def derenderer(tiny_model) -> Derenderer:
    return Derenderer(Renderer(RenderConfig(model=tiny_model)), StreamStateCodec(KEY))


def test_state_is_bound_to_its_request(derenderer):
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    out = derenderer.chat_stream_chunk({"request_id": "a", "choices": [{"token_ids": [300]}]}, None, request)
    with pytest.raises(InvalidRequestError, match="another request"):
        derenderer.chat_stream_chunk(
            {"request_id": "b", "choices": [{"token_ids": [301]}]}, out["stream_state"], request
        )
    with pytest.raises(InvalidRequestError, match="signature"):
        derenderer.chat_stream_chunk(
            {"request_id": "a", "choices": [{"token_ids": [301]}]}, out["stream_state"][:-3] + "abc", request
        )


def test_state_size_stays_flat_over_a_long_answer(derenderer):
    tokenizer = derenderer.tokenizer
    body = " ".join(f"step {i} of the plan, check the cache and the tool." for i in range(120))
    text = (
        f"<think>\n{body}\n</think>\n\n{body[:2000]}\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"notes": "{body[:3000]}", '
        '"city": "Paris"}}\n</tool_call>'
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= 1000
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
            ],
        }
    )
    state, sizes, arguments = None, [], ""
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out = derenderer.chat_stream_chunk(
            {
                "request_id": "long",
                "choices": [{"token_ids": [token], "finish_reason": "stop" if last else None}],
            },
            state,
            request,
        )
        state = out["stream_state"]
        sizes.append(len(state))
        for choice in out["chunk"]["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                arguments += call["function"].get("arguments", "")
    assert out["chunk"]["choices"][0]["finish_reason"] == "tool_calls"
    assert arguments.startswith('{"notes": "step 0') and arguments.endswith('"city": "Paris"}')
    # the state holds parser state, not the output: flat within the reasoning/content phase and
    # within the tool call (whose parser state is a fixed set of fields larger than content's)
    call_start = next(i for i, size in enumerate(sizes) if size > sizes[100] + 64)
    assert len(ids) - call_start > 500
    assert max(sizes[100:call_start]) - min(sizes[100:call_start]) <= 16
    in_call = sizes[call_start + 50 : call_start + 500]  # inside the long arguments string
    assert max(in_call) - min(in_call) <= 16
    assert max(sizes) < 600
