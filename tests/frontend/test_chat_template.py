"""Chat templates: token IDs equal transformers' apply_chat_template; sandbox and loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from splitserve.frontend.chat_template import (
    RESERVED_VARIABLES,
    ChatTemplate,
    ChatTemplateCache,
    TemplateError,
    load_chat_template,
)
from splitserve.frontend.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville — 東京 ok <b>&</b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}

CHATS = {
    "user_only": dict(messages=[{"role": "user", "content": "Hello there"}], add_generation_prompt=True),
    "system": dict(
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        add_generation_prompt=True,
    ),
    "no_generation_prompt": dict(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ),
    "multi_turn_reasoning_dropped": dict(
        messages=[
            {"role": "system", "content": "Think first."},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "reasoning_content": "early thoughts", "content": "first answer"},
            {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "<think>\ninline thoughts\n</think>\n\nsecond answer"},
            {"role": "user", "content": "third question"},
        ],
        add_generation_prompt=True,
    ),
    "reasoning_after_last_user_kept": dict(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "reasoning": "kept thoughts", "content": "a", "tool_calls": None},
        ]
    ),
    "tools_and_responses": dict(
        messages=[
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris and Tokyo?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I need two calls.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "東京"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
            {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 18}'},
        ],
        tools=[WEATHER_TOOL, SEARCH_TOOL],
        add_generation_prompt=True,
    ),
    "tools_no_system": dict(
        messages=[{"role": "user", "content": "search cats"}], tools=[SEARCH_TOOL], add_generation_prompt=True
    ),
    "enable_thinking_false": dict(
        messages=[{"role": "user", "content": "quick answer please"}],
        add_generation_prompt=True,
        enable_thinking=False,
    ),
    "continue_final_message": dict(
        messages=[
            {"role": "user", "content": "Write a haiku"},
            {"role": "assistant", "content": "Autumn moonlight, "},
        ],
        continue_final_message=True,
    ),
    "non_ascii": dict(
        messages=[
            {"role": "system", "content": "Réponds en français. 你好 🙂"},
            {"role": "user", "content": "Größe? naïve café — “quoted” 🚀 こんにちは"},
        ],
        add_generation_prompt=True,
    ),
    "content_parts": dict(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
            }
        ],
        add_generation_prompt=True,
    ),
    "special_token_text_in_content": dict(
        messages=[{"role": "user", "content": "literal <|im_end|> and <think> inside"}],
        add_generation_prompt=True,
    ),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


@pytest.fixture(scope="module")
def template(tiny_model) -> ChatTemplate:
    return load_chat_template(tiny_model)


def _hf_ids(hf_tokenizer, chat: dict) -> list[int]:
    kwargs = dict(chat)
    messages = kwargs.pop("messages")
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    if not isinstance(out, list):  # transformers 5: a BatchEncoding
        out = out["input_ids"]
    return list(out)


@pytest.mark.parametrize("name", sorted(CHATS))
def test_token_ids_equal_transformers(name, hf_tokenizer, tokenizer, template):
    chat = dict(CHATS[name])
    messages = chat.pop("messages")
    text = template.render(messages, **chat)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, **chat)
    assert tokenizer.encode(text) == _hf_ids(hf_tokenizer, CHATS[name])


def _render(template: ChatTemplate, name: str) -> str:
    chat = dict(CHATS[name])
    return template.render(chat.pop("messages"), **chat)


def test_reasoning_of_earlier_turns_is_dropped(template):
    text = _render(template, "multi_turn_reasoning_dropped")
    assert "early thoughts" not in text and "inline thoughts" not in text
    assert "first answer" in text and "second answer" in text
    kept = _render(template, "reasoning_after_last_user_kept")
    assert "<think>\nkept thoughts\n</think>" in kept


def test_enable_thinking_false_closes_think(template):
    text = _render(template, "enable_thinking_false")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_caller_messages_are_not_modified(template):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    snapshot = json.dumps(messages)
    text = template.render(messages, continue_final_message=True)
    assert text.endswith("partial") and json.dumps(messages) == snapshot


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        ([{"role": "wizard", "content": "x"}], {}, "unknown role"),
        ([{"role": "user", "content": 42}], {}, "string or a list"),
        (
            [{"role": "user", "content": "x"}],
            {"add_generation_prompt": True, "continue_final_message": True},
            "both",
        ),
        ([], {"continue_final_message": True}, "no messages"),
        (["not a dict"], {}, "must be an object"),
        ("not a list", {}, "list"),
    ],
)
def test_bad_messages_raise_template_error(template, messages, kwargs, match):
    with pytest.raises(TemplateError, match=match):
        template.render(messages, **kwargs)


def test_tools_must_be_objects(template):
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}], tools=["nope"])


def test_template_error_is_a_value_error():
    assert issubclass(TemplateError, ValueError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",  # sandbox: no dunder access
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",  # immutable sandbox: no mutation of inputs
        "{{ 1 / 0 }}",
        "{{ raise_exception('custom failure') }}",
        "{{ messages[5].content }}",
    ],
)
def test_sandbox_and_runtime_errors(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_syntax_error_at_compile_time():
    with pytest.raises(TemplateError, match="syntax"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(TemplateError):
        ChatTemplate("")


def test_helpers_match_hf():
    tmpl = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}"
        "|{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}|{% generation %}gen{% endgeneration %}"
        "|{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|{{ eos_token }}",
        special_tokens={"eos_token": "<eos>"},
    )
    x = {"b": "é <b>&</b> 🙂", "a": [1, None, True]}
    parts = tmpl.render([], x=x).split("|")
    assert parts[0] == json.dumps(x, ensure_ascii=False)
    assert parts[1] == json.dumps(x, ensure_ascii=False, indent=2)
    assert parts[2] == json.dumps(x, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    assert len(parts[3]) == 4 and parts[3].isdigit()
    assert parts[4:] == ['{"a": 1}', "gen", "01", "<eos>"]
    # a template kwarg overrides a special token variable, as in HF
    assert ChatTemplate("{{ eos_token }}", special_tokens={"eos_token": "E"}).render([], eos_token="X") == "X"


def test_none_fields_are_dropped_and_reasoning_aliased():
    tmpl = ChatTemplate(
        "{% for m in messages %}{{ m.content is defined }},{{ m.thinking }},"
        "{{ m.reasoning_content }};{% endfor %}"
    )
    out = tmpl.render([{"role": "assistant", "content": None, "reasoning": "r"}])
    assert out == "False,r,r;"


def _copy_model(src: str, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(src, name), dst / name)
    return dst


def test_load_sources(tiny_model, tmp_path):
    model_template = load_chat_template(tiny_model)
    assert "<|im_start|>" in model_template.source
    assert model_template.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

    literal = load_chat_template(tiny_model, "{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert literal.render([{"role": "user", "content": "x"}]) == "[x]"
    path = tmp_path / "t.jinja"
    path.write_text("FILE {{ messages | length }}")
    assert load_chat_template(tiny_model, str(path)).render([{"role": "user", "content": "x"}]) == "FILE 1"
    with pytest.raises(TemplateError, match="neither"):
        load_chat_template(tiny_model, "no-such-file.jinja")

    # a list of named templates: "default" is used
    named = _copy_model(tiny_model, tmp_path / "named")
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEF"},
    ]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(str(named)).render([]) == "DEF"
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="default"):
        load_chat_template(str(named))

    # transformers 5 may save the template beside the config instead
    separate = _copy_model(tiny_model, tmp_path / "separate")
    config = json.loads((separate / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (separate / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="no chat template"):
        load_chat_template(str(separate))
    (separate / "chat_template.jinja").write_text("JINJA")
    assert load_chat_template(str(separate)).render([]) == "JINJA"


def test_cache_compiles_once_and_is_bounded(tiny_model):
    cache = ChatTemplateCache(max_entries=2)
    first = cache.load(tiny_model)
    assert cache.load(tiny_model) is first
    assert load_chat_template(tiny_model, cache=cache) is first
    assert load_chat_template(tiny_model) is not first  # no cache: a fresh compile
    a, b = cache.get("A"), cache.get("B")
    assert len(cache) == 2 and cache.get("B") is b
    assert cache.get("A") is a  # A is now the most recent
    cache.get("C")
    assert cache.get("A") is a and cache.get("B") is not b  # B was evicted
    # the special tokens are part of the key
    assert cache.get("A", {"eos_token": "x"}) is not a


def test_template_kwargs_cannot_replace_the_messages(template):
    with pytest.raises(TemplateError, match="messages"):
        template.render([{"role": "user", "content": "x"}], **{"messages": []})
    assert {"messages", "tools", "add_generation_prompt"} <= RESERVED_VARIABLES
