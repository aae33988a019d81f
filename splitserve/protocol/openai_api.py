"""The OpenAI chat/completions requests the render tier accepts, validated up front.

Anything a client can get wrong is rejected here with a message naming the field, so the
template, tokenizer and engine only ever see well-formed requests. Unknown top-level fields
are ignored (as vLLM and OpenAI do); unsupported features that would change the output
(guided decoding, penalties) are refused rather than silently dropped. Images come as
`image_url` content parts of user messages (the renderer loads and checks them).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 8
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_JSON_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
# Template variables a client may not override through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url"):
                    raise ValueError(
                        f"content part type {kind!r} is not supported (only 'text', 'image_url')"
                    )
        return value

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role != "assistant" and self.tool_calls:
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role != "user" and self.image_urls():
            raise ValueError("only user messages may carry images")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImageUrlPart)]


def _check_schema(schema: Any, path: str) -> None:
    """A light JSON-schema sanity check: enough to refuse what no template or model can use."""
    if not isinstance(schema, dict):
        raise ValueError(f"{path} must be a JSON schema object")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for item in kinds:
        if item not in _JSON_SCHEMA_TYPES:
            raise ValueError(f"{path}.type {item!r} is not a JSON schema type")
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise ValueError(f"{path}.properties must be an object")
        for name, sub in properties.items():
            _check_schema(sub, f"{path}.properties.{name}")
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(item, str) for item in required)
    ):
        raise ValueError(f"{path}.required must be a list of property names")
    if "items" in schema and isinstance(schema["items"], dict):
        _check_schema(schema["items"], f"{path}.items")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _FUNCTION_NAME.match(value):
            raise ValueError("function name must be 1-64 characters of letters, digits, _ . -")
        return value

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        if value.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON schema of type 'object'")
        _check_schema(value, "parameters")
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class _SamplingFields(BaseModel):
    """Fields the chat and completions requests share."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # validated once at the edge, then read-only
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None
    request_id: str | None = Field(default=None, max_length=256)
    # a routing hint for the P/D proxy (which decode worker served this conversation);
    # the KV index finds the holder without it, and no engine ever sees it
    conversation_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative")
        return value

    @model_validator(mode="after")
    def _no_penalties(self) -> _SamplingFields:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (only 0)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(_RESERVED_TEMPLATE_KWARGS & set(value or {}))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def parses_tool_calls(self) -> bool:
        """Tool calls are parsed from the output unless there are no tools or tool_choice is
        'none'. 'required' and a named function are parsed like 'auto': generation is not
        constrained (there is no guided decoding), so the model may still answer in text."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template shows the model; a named tool_choice shows only that one."""
        if not self.tools:
            return None
        tools = self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        return [t.model_dump(exclude_none=True) for t in tools]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], list) and any(not ids for ids in value):
                raise ValueError("a token-ID prompt must not be empty")
            if isinstance(value[0], int) and any(t < 0 for t in value):
                raise ValueError("token IDs must be non-negative")
        return value

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token IDs)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
