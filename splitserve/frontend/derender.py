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

from splitserve.frontend.choice_decoder import ChoiceDecoder
from splitserve.frontend.render import Renderer
from splitserve.frontend.stream_state import StreamStateCodec, StreamStateError
from splitserve.frontend.way_back import DecoderSeed, chat_options, feed
from splitserve.protocol.engine_api import choice_logprobs
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.frontend_client import DerenderPiece
from splitserve.protocol.openai_api import ChatCompletionRequest
from splitserve.protocol.openai_chunks import MessageAssembler, chunk_choice, usage_dict


def chat_id(request_id: str) -> str:
    return request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id}"


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
        options = chat_options(self.renderer, request)
        starts_in_reasoning = self._starts_in_reasoning(request, prompt_token_ids)
        choices = []
        completion_tokens = 0
        return_ids = bool(request and request.return_token_ids)
        seed = DecoderSeed(str(generate_response.get("request_id")), options, starts_in_reasoning)
        for raw in generate_response.get("choices") or []:
            index = int(raw.get("index", 0))
            token_ids = raw.get("token_ids") or []
            engine_reason = raw.get("finish_reason")
            piece = DerenderPiece(seed, index, token_ids, choice_logprobs(raw), engine_reason, True)
            result = feed(self.renderer, seed, piece)
            assembler = MessageAssembler()
            assembler.add(result.delta)
            completion_tokens += result.delta.num_tokens
            reason = result.finish_reason or "stop"
            choices.append(assembler.choice(index, reason, token_ids if return_ids else None))
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
        options = chat_options(self.renderer, request)
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
                raise InvalidRequestError(str(exc), param="stream_state") from exc
            if state.get("rid") != request_id:
                raise InvalidRequestError("stream_state belongs to another request", param="stream_state")
        return_ids = bool(request and request.return_token_ids)
        choices = []
        for raw in generate_chunk.get("choices") or []:
            index = int(raw.get("index", 0))
            saved = state["ch"].get(str(index))
            if saved is not None and saved["fin"]:
                continue  # finished by a stop string: the engine's trailing tokens are dropped
            try:
                start = (
                    DecoderSeed(request_id, options, state["sir"])
                    if saved is None
                    else ChoiceDecoder.from_state(self.tokenizer, options, saved["dec"])
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    "stream_state does not match this request's options", param="stream_state"
                ) from exc
            token_ids = raw.get("token_ids") or []
            engine_reason = raw.get("finish_reason")
            piece = DerenderPiece(start, index, token_ids, choice_logprobs(raw), engine_reason, False)
            decoder, delta, finish_reason, _ = feed(self.renderer, start, piece)
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
