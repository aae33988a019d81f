"""Derender: the engine's token IDs → OpenAI chat completion responses and stream chunks.

Non-streaming turns a whole generate response into a `chat.completion`. Streaming turns
one generate chunk plus the previous signed `stream_state` into one `chat.completion.chunk`
plus the next state. The state holds the parsers' compact state, not the output so far,
so each call costs O(new tokens) and any render replica sharing the key can serve it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from splitserve.frontend.choice_decoder import ChoiceDecoder, ChoiceDelta, DecodeOptions
from splitserve.frontend.protocol import ChatCompletionRequest, RequestError
from splitserve.frontend.render import Renderer
from splitserve.frontend.stream_state import StreamStateCodec, StreamStateError


def decode_options(renderer: Renderer, request: ChatCompletionRequest | None) -> DecodeOptions:
    if request is None:
        return DecodeOptions(reasoning=renderer.reasoning)
    return DecodeOptions(
        stop=request.stop_strings(),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        reasoning=renderer.reasoning,
        tools=renderer.tools and request.parses_tool_calls(),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
    )


def merge_deltas(first: ChoiceDelta, second: ChoiceDelta) -> ChoiceDelta:
    logprobs = first.logprobs if second.logprobs is None else (first.logprobs or []) + second.logprobs
    return ChoiceDelta(
        first.reasoning + second.reasoning,
        first.content + second.content,
        first.tool_calls + second.tool_calls,
        logprobs,
        first.num_tokens + second.num_tokens,
    )


def final_finish_reason(engine_reason: str | None, decoder: ChoiceDecoder) -> str:
    """A stop string ends as "stop"; a stop that produced tool calls is "tool_calls"."""
    reason = "stop" if decoder.stopped else engine_reason or "stop"
    if reason == "stop" and decoder.num_tool_calls:
        return "tool_calls"
    return reason


def chat_id(request_id: str) -> str:
    return request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id}"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def delta_dict(delta: ChoiceDelta, *, role: bool) -> dict[str, Any]:
    """The `delta` object of a chat.completion.chunk choice."""
    out: dict[str, Any] = {}
    if role:
        out["role"] = "assistant"
    if delta.reasoning:
        out["reasoning"] = delta.reasoning
        out["reasoning_content"] = delta.reasoning  # the older field name some clients read
    if delta.content or (role and not delta.reasoning and not delta.tool_calls):
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for call in delta.tool_calls:
            item: dict[str, Any] = {"index": call.index}
            function: dict[str, Any] = {}
            if call.id is not None:
                item["id"] = call.id
                item["type"] = "function"
            if call.name is not None:
                function["name"] = call.name
            if call.arguments:
                function["arguments"] = call.arguments
            item["function"] = function
            calls.append(item)
        out["tool_calls"] = calls
    return out


def chunk_choice(
    index: int,
    delta: ChoiceDelta,
    *,
    role: bool,
    finish_reason: str | None,
    token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta_dict(delta, role=role),
        "logprobs": {"content": delta.logprobs} if delta.logprobs else None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


class MessageAssembler:
    """Collects one choice's deltas into a non-streaming `message`."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.reasoning.append(delta.reasoning)
        self.content.append(delta.content)
        for call in delta.tool_calls:
            entry = self.calls.setdefault(
                call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.id is not None:
                entry["id"] = call.id
            if call.name is not None:
                entry["function"]["name"] = call.name
            if call.arguments:
                entry["function"]["arguments"] += call.arguments
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs

    def choice(
        self, index: int, finish_reason: str, token_ids: Sequence[int] | None = None
    ) -> dict[str, Any]:
        reasoning = "".join(self.reasoning)
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self.calls else None,
            "reasoning": reasoning or None,
            "reasoning_content": reasoning or None,
        }
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
            "finish_reason": finish_reason,
        }
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return choice


def _choice_logprobs(choice: dict[str, Any]) -> list[dict] | None:
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return None
    return list(logprobs.get("content") or []) if isinstance(logprobs, dict) else list(logprobs)


class Derenderer:
    def __init__(self, renderer: Renderer, codec: StreamStateCodec) -> None:
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.codec = codec

    def _starts_in_reasoning(
        self, request: ChatCompletionRequest | None, prompt_token_ids: Sequence[int] | None
    ) -> bool:
        if not self.renderer.reasoning:
            return False
        if prompt_token_ids is None:
            if request is None:
                return False
            prompt_token_ids = self.renderer.chat_token_ids(request)
        return self.renderer.starts_in_reasoning(list(prompt_token_ids))

    def chat_response(
        self,
        generate_response: dict[str, Any],
        request: ChatCompletionRequest | None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
    ) -> dict[str, Any]:
        prompt_token_ids = prompt_token_ids or generate_response.get("prompt_token_ids")
        options = decode_options(self.renderer, request)
        starts_in_reasoning = self._starts_in_reasoning(request, prompt_token_ids)
        choices = []
        completion_tokens = 0
        return_ids = bool(request and request.return_token_ids)
        for raw in generate_response.get("choices") or []:
            decoder = ChoiceDecoder(
                self.tokenizer,
                options,
                starts_in_reasoning=starts_in_reasoning,
                tool_id_salt=f"{generate_response.get('request_id')}:{raw.get('index', 0)}",
            )
            assembler = MessageAssembler()
            token_ids = raw.get("token_ids") or []
            assembler.add(decoder.feed(token_ids, _choice_logprobs(raw)))
            assembler.add(decoder.finish())
            completion_tokens += decoder.num_tokens
            reason = final_finish_reason(raw.get("finish_reason"), decoder)
            choices.append(
                assembler.choice(int(raw.get("index", 0)), reason, token_ids if return_ids else None)
            )
        prompt_count = _prompt_count(generate_response, prompt_token_ids, prompt_tokens)
        response: dict[str, Any] = {
            "id": chat_id(str(generate_response.get("request_id") or "derender")),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.renderer.model_name,
            "choices": choices,
            "usage": usage_dict(prompt_count, completion_tokens),
        }
        if return_ids and prompt_token_ids is not None:
            response["prompt_token_ids"] = list(prompt_token_ids)
        return response

    def chat_stream_chunk(
        self,
        generate_chunk: dict[str, Any],
        stream_state: str | None,
        request: ChatCompletionRequest | None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
    ) -> dict[str, Any]:
        """One generate stream chunk → {chunk, stream_state}."""
        request_id = str(generate_chunk.get("request_id") or "")
        options = decode_options(self.renderer, request)
        prompt_token_ids = prompt_token_ids or generate_chunk.get("prompt_token_ids")
        if stream_state is None:
            state: dict[str, Any] = {
                "rid": request_id,
                "created": int(time.time()),
                "pt": _prompt_count(generate_chunk, prompt_token_ids, prompt_tokens),
                "sir": self._starts_in_reasoning(request, prompt_token_ids),
                "ch": {},
            }
        else:
            try:
                state = self.codec.decode(stream_state)
            except StreamStateError as exc:
                raise RequestError(str(exc), param="stream_state") from exc
            if state.get("rid") != request_id:
                raise RequestError("stream_state belongs to another request", param="stream_state")
        return_ids = bool(request and request.return_token_ids)
        choices = []
        for raw in generate_chunk.get("choices") or []:
            index = int(raw.get("index", 0))
            saved = state["ch"].get(str(index))
            if saved is not None and saved["fin"]:
                continue  # finished by a stop string: the engine's trailing tokens are dropped
            try:
                decoder = (
                    ChoiceDecoder(
                        self.tokenizer,
                        options,
                        starts_in_reasoning=state["sir"],
                        tool_id_salt=f"{request_id}:{index}",
                    )
                    if saved is None
                    else ChoiceDecoder.from_state(self.tokenizer, options, saved["dec"])
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise RequestError(
                    "stream_state does not match this request's options", param="stream_state"
                ) from exc
            token_ids = raw.get("token_ids") or []
            delta = decoder.feed(token_ids, _choice_logprobs(raw))
            finish_reason = None
            if decoder.stopped or raw.get("finish_reason") is not None:
                delta = merge_deltas(delta, decoder.finish())
                finish_reason = final_finish_reason(raw.get("finish_reason"), decoder)
            choices.append(
                chunk_choice(
                    index,
                    delta,
                    role=saved is None,
                    finish_reason=finish_reason,
                    token_ids=token_ids[: delta.num_tokens] if return_ids else None,
                )
            )
            state["ch"][str(index)] = {"dec": decoder.state(), "fin": finish_reason is not None}
        chunk: dict[str, Any] = {
            "id": chat_id(request_id),
            "object": "chat.completion.chunk",
            "created": state["created"],
            "model": self.renderer.model_name,
            "choices": choices,
        }
        if return_ids and stream_state is None and prompt_token_ids is not None:
            chunk["prompt_token_ids"] = list(prompt_token_ids)
        if request is not None and request.include_usage():
            all_done = bool(state["ch"]) and all(c["fin"] for c in state["ch"].values())
            completion = sum(int(c["dec"]["n"]) for c in state["ch"].values())
            chunk["usage"] = usage_dict(state["pt"], completion) if all_done else None
        return {"chunk": chunk, "stream_state": self.codec.encode(state)}


def _prompt_count(
    generate: dict[str, Any], prompt_token_ids: Sequence[int] | None, prompt_tokens: int | None
) -> int:
    if prompt_tokens is not None:
        return prompt_tokens
    if prompt_token_ids is not None:
        return len(prompt_token_ids)
    usage = generate.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0)
