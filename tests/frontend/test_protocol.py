"""Validation of the OpenAI chat/completions requests the render tier accepts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def test_minimal_and_full_requests_parse():
    request = chat()
    assert request.n == 1 and request.add_generation_prompt and not request.stream
    full = chat(
        model="m",
        n=3,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        seed=3,
        stop=["a", "b"],
        logprobs=True,
        top_logprobs=4,
        stream=True,
        stream_options={"include_usage": True},
        tools=[WEATHER],
        tool_choice="auto",
        chat_template_kwargs={"enable_thinking": False},
        return_token_ids=True,
        cache_salt="s",
    )
    assert full.max_output_tokens() == 7 and full.include_usage() and full.stop_strings() == ("a", "b")
    assert full.parses_tool_calls()


def test_message_shapes():
    parts = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert parts.messages[0].text() == "ab"
    calls = chat(
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "developer", "content": "be brief"},
        ]
    )
    assert [m.role for m in calls.messages] == ["user", "assistant", "tool", "developer"]


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
        {"n": 0},
        {"n": 9},
        {"max_tokens": 0},
        {"max_completion_tokens": -1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_logprobs": 21, "logprobs": True},
        {"top_logprobs": 2},
        {"stop": [""]},
        {"stop": ["x"] * 17},
        {"stream_options": {"include_usage": True}},
        {"presence_penalty": 0.5},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "strange"}}},
                    },
                }
            ]
        },
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "required": "x"}},
                }
            ]
        },
        {"tools": [{"type": "retrieval"}]},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
        {"tool_choice": "required"},
        {"tool_choice": "sometimes", "tools": [WEATHER]},
        {"continue_final_message": True},
        {"chat_template_kwargs": {"messages": []}},
        {"cache_salt": ""},
    ],
)
def test_invalid_chat_requests_are_refused(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_tool_choice_variants():
    assert not chat(tools=[WEATHER], tool_choice="none").parses_tool_calls()
    named = chat(
        tools=[WEATHER, {"type": "function", "function": {"name": "other"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert named.parses_tool_calls()
    assert [t["function"]["name"] for t in named.template_tools()] == ["get_weather"]
    assert not chat().parses_tool_calls() and chat().template_tools() is None


def test_continue_final_message():
    request = chat(
        messages=[*USER, {"role": "assistant", "content": "Sure"}],
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert request.continue_final_message


def test_completion_requests():
    assert CompletionRequest.model_validate({"prompt": "hi"}).prompts() == ["hi"]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    for bad in (
        {"prompt": []},
        {"prompt": [-1]},
        {"prompt": "x", "echo": True},
        {"prompt": "x", "logprobs": 6},
        {"prompt": "x", "n": 9},
        {"prompt": [[]]},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
