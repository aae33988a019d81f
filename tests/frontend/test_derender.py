"""Derender: generate responses/chunks → chat completions, streaming equal to non-streaming."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.frontend.derender import Derenderer
from splitserve.frontend.render import RenderConfig, Renderer
from splitserve.frontend.stream_state import StreamStateCodec
from splitserve.protocol.openai_api import ChatCompletionRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
OUTPUT = (
    "<think>\nThe user wants the weather. 東京 too?\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "a </tool_call> b"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def derenderer(tiny_model) -> Derenderer:
    return Derenderer(Renderer(RenderConfig(model=tiny_model)), StreamStateCodec(b"test-key-0123456789"))


def chat(**fields) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return ChatCompletionRequest.model_validate(fields)


def response(ids: list[int], finish: str = "stop", **choice) -> dict:
    return {
        "request_id": "r1",
        "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, **choice}],
    }


def stream(derenderer: Derenderer, ids: list[int], request, sizes, finish="stop", **kwargs) -> list[dict]:
    """Feed `ids` in chunks of the given sizes; returns every chunk."""
    chunks, state, at = [], None, 0
    sizes = iter(sizes)
    while at < len(ids):
        size = next(sizes)
        piece = ids[at : at + size]
        at += size
        last = at >= len(ids)
        gen = {
            "request_id": "r1",
            "choices": [{"index": 0, "token_ids": piece, "finish_reason": finish if last else None}],
        }
        out = derenderer.chat_stream_chunk(gen, state, request, **kwargs)
        state = out["stream_state"]
        chunks.append(out["chunk"])
    return chunks


def assemble(chunks: list[dict]) -> dict:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def test_reasoning_content_and_tool_calls(derenderer):
    ids = derenderer.tokenizer.encode(OUTPUT)
    result = derenderer.chat_response(response(ids), chat(tools=[WEATHER, SEARCH]))
    choice = result["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "The user wants the weather. 東京 too?"
    assert message["content"] == "Let me check."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    assert json.loads(calls[1]["function"]["arguments"]) == {"q": "a </tool_call> b"}
    assert calls[0]["id"] != calls[1]["id"] and all(c["type"] == "function" for c in calls)
    assert choice["finish_reason"] == "tool_calls"
    assert result["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("seed", range(4))
def test_streaming_equals_non_streaming(derenderer, seed):
    ids = derenderer.tokenizer.encode(OUTPUT)
    request = chat(tools=[WEATHER, SEARCH])
    whole = derenderer.chat_response(response(ids), request)["choices"][0]["message"]
    rng = random.Random(seed)
    sizes = [1] * len(ids) if seed == 0 else [rng.randint(1, 6) for _ in ids]
    chunks = stream(derenderer, ids, request, sizes)
    got = assemble(chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert got["reasoning"] == whole["reasoning"] and got["content"] == whole["content"]
    assert [(c["id"], c["name"], c["arguments"]) for c in got["calls"]] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    assert got["finish"] == "tool_calls"


def test_tool_choice_none_keeps_calls_as_content(derenderer):
    ids = derenderer.tokenizer.encode(OUTPUT)
    message = derenderer.chat_response(response(ids), chat(tools=[WEATHER], tool_choice="none"))["choices"][0]
    assert "tool_calls" not in message["message"] and "<tool_call>" in message["message"]["content"]
    assert message["finish_reason"] == "stop"


def test_prompt_that_opens_reasoning(derenderer):
    tokenizer = derenderer.tokenizer
    ids = tokenizer.encode("still thinking</think>\n\nThe answer.")
    prompt_ids = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    message = derenderer.chat_response(response(ids), chat(), prompt_token_ids=prompt_ids)["choices"][0][
        "message"
    ]
    assert message["reasoning"] == "still thinking" and message["content"] == "The answer."
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = derenderer.chat_response(response(ids), chat(), prompt_token_ids=closed)["choices"][0][
        "message"
    ]
    assert message["reasoning"] is None


def test_stop_strings_streaming_and_not(derenderer):
    ids = derenderer.tokenizer.encode("The answer is 42. STOP here and more text")
    request = chat(stop=["STOP"])
    whole = derenderer.chat_response(response(ids, finish="length"), request)["choices"][0]
    assert whole["message"]["content"] == "The answer is 42. " and whole["finish_reason"] == "stop"
    chunks = stream(derenderer, ids, request, [1] * len(ids), finish="length")
    got = assemble(chunks)
    assert got["content"] == "The answer is 42. " and got["finish"] == "stop"
    # chunks after the stop carry no choices: the client should abort the engine request
    assert chunks[-1]["choices"] == []
    with_stop = derenderer.chat_response(response(ids), chat(stop="STOP", include_stop_str_in_output=True))
    assert with_stop["choices"][0]["message"]["content"] == "The answer is 42. STOP"


def test_logprobs_get_token_strings(derenderer):
    tokenizer = derenderer.tokenizer
    ids = tokenizer.encode("hello world")
    logprobs = {
        "content": [
            {
                "token_id": t,
                "logprob": -0.5,
                "top_logprobs": [{"token_id": t, "logprob": -0.5}, {"token_id": 7, "logprob": -1.0}],
            }
            for t in ids
        ]
    }
    request = chat(logprobs=True, top_logprobs=1)
    result = derenderer.chat_response(response(ids, logprobs=logprobs), request)["choices"][0]["logprobs"][
        "content"
    ]
    assert "".join(entry["token"] for entry in result) == "hello world"
    assert all(
        len(entry["top_logprobs"]) == 1 and entry["bytes"] == list(entry["token"].encode())
        for entry in result
    )


def test_return_token_ids_and_usage_in_stream(derenderer):
    ids = derenderer.tokenizer.encode("Plain answer.")
    request = chat(return_token_ids=True, stream=True, stream_options={"include_usage": True})
    chunks = stream(derenderer, ids, request, [2] * len(ids), prompt_token_ids=[1, 2, 3])
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == ids
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "total_tokens": 3 + len(ids),
    }
