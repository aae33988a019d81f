"""Hugging Face chat templates rendered in a sandboxed jinja2 environment.

Parity with transformers' `apply_chat_template` is the goal (its token IDs are the test
oracle): the same sandbox (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks,
loopcontrols, `{% generation %}`), the same helpers (`raise_exception`, `strftime_now`,
`tojson`, `dict`, a `namespace` that rejects underscore attributes), the same message
normalisation (None-valued keys dropped, reasoning aliased under `reasoning_content` and
`thinking`), the special tokens passed as template variables, and the same
`continue_final_message` trick (tag the final message, cut the render at the tag).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Set by `render` itself: callers passing chat_template_kwargs should refuse these keys.
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TemplateError(ValueError):
    """A chat template failed to compile or to render, or rejected the messages."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (no path to internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message: str) -> None:
    raise TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters and forces ASCII; HF templates expect neither.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """A deep copy made of JSON types only (the template may not reach other objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums...) carry methods the sandbox does not know
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list of message objects")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"each message must be an object, got {type(message).__name__}")
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template. Thread-safe: rendering shares no mutable state."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source:
            raise TemplateError("chat template must be a non-empty string")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error (line {exc.lineno}): {exc.message}") from exc

    def render(
        self,
        messages: list[dict],
        /,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt cannot both be set")
        reserved = RESERVED_VARIABLES.intersection(template_kwargs)
        if reserved:
            raise TemplateError(f"template variables {sorted(reserved)} cannot be set by keyword arguments")
        chat = _normalize_messages(messages)
        if tools is not None and not (
            isinstance(tools, (list, tuple)) and all(isinstance(t, Mapping) for t in tools)
        ):
            raise TemplateError("tools must be a list of objects")
        final_text = self._tag_final_message(chat, continue_final_message) if continue_final_message else None
        variables = {**self.special_tokens, **_plain(template_kwargs)}
        try:
            rendered = self._template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError:
            raise
        except RecursionError as exc:
            raise TemplateError("chat template failed to render: recursion too deep") from exc
        except Exception as exc:  # the template is code run on client data: any failure is a 4xx
            raise TemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
        if final_text is not None:
            rendered = self._cut_at_tag(rendered, final_text)
        return rendered

    def _tag_final_message(self, chat: list[dict], continue_final_message: bool | str) -> str:
        """Append a tag to the final message's text (as HF does) and return that text."""
        if not chat:
            raise TemplateError("continue_final_message is set but there are no messages")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise TemplateError(f"continue_final_message is set but the final message has no {field!r}")
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in self.source for f in fields):
            raise TemplateError(f"continue_final_message: the chat template does not use {field!r}")
        if isinstance(final, list):
            for block in reversed(final):
                if isinstance(block, dict) and isinstance(block.get("text"), str):
                    text = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    return text
            raise TemplateError("continue_final_message: the final message has no text to continue")
        if not isinstance(final, str):
            raise TemplateError("continue_final_message: the final message's content must be text")
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_at_tag(rendered: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise TemplateError("continue_final_message: the chat template dropped part of the final message")
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_from_config(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens HF passes to templates as variables (`eos_token`, ...)."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = _token_content(tokenizer_config.get(key))
        if content is not None:
            out[key] = content
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _select_template(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates, as HF saves them
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TemplateError(f"{where}: no template named 'default' among {sorted(map(str, named))}")
    raise TemplateError(f"{where}: chat_template must be a string or a list of named templates")


def find_template_source(model_dir: str, override: str | None = None) -> str:
    """The chat template text: the override (a file path or a literal template), else the
    model directory's (tokenizer_config.json, chat_template.jinja, chat_template.json)."""
    if override:
        if os.path.isfile(override):
            return Path(override).read_text(encoding="utf-8")
        if "{{" in override or "{%" in override:
            return override
        raise TemplateError(f"chat template override {override!r} is neither a file nor a jinja template")
    directory = Path(model_dir)
    config = _read_json(directory / "tokenizer_config.json")
    if config.get("chat_template") is not None:
        return _select_template(config["chat_template"], "tokenizer_config.json")
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    extra = _read_json(directory / "chat_template.json")
    if extra.get("chat_template") is not None:
        return _select_template(extra["chat_template"], "chat_template.json")
    raise TemplateError(f"{model_dir}: the model has no chat template; pass one explicitly")


class ChatTemplateCache:
    """Compiled templates keyed by a hash of their source and special tokens (LRU)."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, source: str, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        tokens = dict(special_tokens or {})
        key = hashlib.blake2b(
            json.dumps([source, sorted(tokens.items())]).encode("utf-8"), digest_size=16
        ).hexdigest()
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        template = ChatTemplate(source, special_tokens=tokens)  # compiled outside the lock
        with self._lock:
            self._entries[key] = template
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return template

    def load(self, model_dir: str, override: str | None = None) -> ChatTemplate:
        return load_chat_template(model_dir, override, cache=self)

    def __len__(self) -> int:
        return len(self._entries)


def load_chat_template(
    model_dir: str, override: str | None = None, *, cache: ChatTemplateCache | None = None
) -> ChatTemplate:
    source = find_template_source(model_dir, override)
    special_tokens = special_tokens_from_config(_read_json(Path(model_dir) / "tokenizer_config.json"))
    if cache is not None:
        return cache.get(source, special_tokens)
    return ChatTemplate(source, special_tokens=special_tokens)
