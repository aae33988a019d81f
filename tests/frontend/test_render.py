"""Render: chat/completions requests → generate requests (token IDs, sampling params, hashes)."""

from __future__ import annotations

import pytest

from splitserve.frontend.render import RenderConfig, Renderer
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def renderer(tiny_model) -> Renderer:
    return Renderer(
        RenderConfig(model=tiny_model, max_model_len=512, block_size=16, trust_request_chat_template=True)
    )


def chat(**fields) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    return ChatCompletionRequest.model_validate(fields)


def test_render_chat_matches_transformers_and_carries_sampling_params(renderer, tiny_model):
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "You are terse. Größe 東京 🙂"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "c1"},
    ]
    request = chat(
        messages=messages,
        tools=[WEATHER],
        max_tokens=20,
        temperature=0,
        seed=7,
        top_k=0,
        stop_token_ids=[5],
        cache_salt="salt",
        stream=True,
        stream_options={"include_usage": True},
    )
    generate = renderer.render_chat(request).to_wire()
    hf = AutoTokenizer.from_pretrained(tiny_model)
    hf_messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    expected = hf.apply_chat_template(hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert generate["token_ids"] == list(expected)
    assert generate["sampling_params"] == {
        "max_tokens": 20,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 7,
        "stop_token_ids": [5],
        "ignore_eos": False,
        "logprobs": None,
    }
    hashes = compute_block_hashes(generate["token_ids"], 16, cache_salt="salt")
    assert generate["block_hashes"] == [h.hex() for h in hashes] and len(hashes) == len(expected) // 16
    assert generate["features"] is None and generate["stream"] is True
    assert generate["stream_options"] == {"include_usage": True}
    assert generate["request_id"].startswith("chatcmpl-")


def test_options_that_change_the_prompt(renderer):
    base = renderer.render_chat(chat()).to_wire()["token_ids"]
    thinking_off = renderer.render_chat(chat(chat_template_kwargs={"enable_thinking": False})).to_wire()[
        "token_ids"
    ]
    assert thinking_off[: len(base)] == base and len(thinking_off) > len(base)
    assert not renderer.starts_in_reasoning(thinking_off)
    developer = chat(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    system = chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert (
        renderer.render_chat(developer).to_wire()["token_ids"]
        == renderer.render_chat(system).to_wire()["token_ids"]
    )
    # a named tool_choice shows only that tool to the model
    named = chat(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}})
    only_search = chat(tools=[SEARCH])
    assert (
        renderer.render_chat(named).to_wire()["token_ids"]
        == renderer.render_chat(only_search).to_wire()["token_ids"]
    )
    continued = chat(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}],
        continue_final_message=True,
        add_generation_prompt=False,
    )
    text = renderer.chat_prompt(continued)
    assert text.endswith("Hello the")


def test_length_limits_and_defaults(renderer):
    prompt_len = len(renderer.render_chat(chat()).to_wire()["token_ids"])
    assert renderer.render_chat(chat()).to_wire()["sampling_params"]["max_tokens"] == 512 - prompt_len
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        renderer.render_chat(chat(max_tokens=512)).to_wire()
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        renderer.render_chat(chat(messages=[{"role": "user", "content": "word " * 600}])).to_wire()
    with pytest.raises(InvalidRequestError) as info:
        renderer.render_chat(chat(model="other-model")).to_wire()
    assert info.value.status == 404


def test_template_errors_become_request_errors(renderer):
    bad = chat(chat_template="{{ raise_exception('no way') }}")
    with pytest.raises(InvalidRequestError, match="no way"):
        renderer.render_chat(bad).to_wire()
    with pytest.raises(InvalidRequestError, match="template"):
        renderer.render_chat(chat(chat_template="{% for %}")).to_wire()
    untrusting = Renderer(RenderConfig(model=renderer.config.model))
    with pytest.raises(InvalidRequestError, match="trust-request-chat-template"):
        untrusting.render_chat(chat(chat_template="{{ messages }}")).to_wire()


def test_render_completion(renderer):
    text = [
        g.to_wire()
        for g in renderer.render_completion(
            CompletionRequest.model_validate({"prompt": "hello world", "max_tokens": 3})
        )
    ]
    assert len(text) == 1 and text[0]["token_ids"] == renderer.tokenizer.encode("hello world")
    assert text[0]["sampling_params"]["max_tokens"] == 3
    batch = [
        g.to_wire()
        for g in renderer.render_completion(
            CompletionRequest.model_validate({"prompt": [[1, 2, 3], [4, 5]], "logprobs": 2})
        )
    ]
    assert [g["token_ids"] for g in batch] == [[1, 2, 3], [4, 5]]
    assert batch[0]["request_id"] != batch[1]["request_id"] and batch[0]["sampling_params"]["logprobs"] == 2
    with pytest.raises(InvalidRequestError, match="vocab"):
        [
            g.to_wire()
            for g in renderer.render_completion(CompletionRequest.model_validate({"prompt": [10**7]}))
        ]
