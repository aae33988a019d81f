"""The OpenAI API as render → engine → derender, over any `EngineClient`.

One place holds the orchestration: the collocated server passes an in-process client, the
P/D proxy can pass one that routes to prefill and decode workers. `n` fans out into n
engine requests (distinct IDs; seeds seed, seed+1, ... when a seed is given), merged as
they stream. A stop string ends a choice in the derender step and aborts its engine request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from splitserve.frontend.choice_decoder import ChoiceDecoder, ChoiceDelta, DecodeOptions
from splitserve.frontend.derender import (
    MessageAssembler,
    chunk_choice,
    decode_options,
    final_finish_reason,
    merge_deltas,
    usage_dict,
)
from splitserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from splitserve.frontend.render import Renderer
from splitserve.server.engine_client import EngineClient
from splitserve.server.errors import APIError
from splitserve.server.merged_streams import MergedStreams
from splitserve.server.request_body import api_error


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _choice_logprobs(choice: dict[str, Any]) -> list[dict] | None:
    logprobs = choice.get("logprobs")
    return None if logprobs is None else list(logprobs.get("content") or [])


class DecodedPiece(NamedTuple):
    index: int  # the choice
    token_ids: list[int]  # the engine tokens decoded into this piece (cut at a matched stop string)
    delta: ChoiceDelta
    finish_reason: str | None  # set on a choice's last piece, which also carries the decoder's flush


class CollectedChoice(NamedTuple):
    deltas: list[ChoiceDelta]
    token_ids: list[int]
    finish_reason: str


async def _decoded(decoders: list[ChoiceDecoder], streams: MergedStreams) -> AsyncIterator[DecodedPiece]:
    """Feed each engine chunk once to its choice's decoder. A choice ends on the engine's
    finish reason or on a matched stop string, which aborts that engine request early."""
    done = [False] * len(decoders)
    async for index, chunk in streams:
        for raw in chunk.get("choices") or []:
            if done[index]:
                continue
            decoder = decoders[index]
            ids = raw.get("token_ids") or []
            delta = decoder.feed(ids, _choice_logprobs(raw))
            reason = None
            if decoder.stopped or raw.get("finish_reason") is not None:
                delta = merge_deltas(delta, decoder.finish())
                reason = final_finish_reason(raw.get("finish_reason"), decoder)
                done[index] = True
                if decoder.stopped:
                    streams.stop(index)
            yield DecodedPiece(index, ids[: delta.num_tokens], delta, reason)


class OpenAIService:
    def __init__(self, renderer: Renderer, engine: EngineClient, model_name: str | None = None) -> None:
        self.renderer = renderer
        self.engine = engine
        self.model_name = model_name or renderer.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    def _fan_out(self, generate: dict[str, Any], n: int, seed: int | None) -> list[dict[str, Any]]:
        bodies = []
        for i in range(n):
            body = {**generate, "stream": True, "sampling_params": dict(generate["sampling_params"])}
            if n > 1:
                body["request_id"] = f"{generate['request_id']}-{i}"
                if seed is not None:
                    body["sampling_params"]["seed"] = seed + i
            bodies.append(body)
        return bodies

    async def _start(self, bodies: list[dict[str, Any]]) -> MergedStreams:
        streams = MergedStreams([self.engine.generate(body) for body in bodies])
        await streams.start()
        return streams

    async def _collect(
        self, decoders: list[ChoiceDecoder], bodies: list[dict[str, Any]]
    ) -> list[CollectedChoice]:
        """Run the engine requests to the end (non-streaming) through their decoders."""
        deltas: list[list[ChoiceDelta]] = [[] for _ in decoders]
        token_ids: list[list[int]] = [[] for _ in decoders]
        reasons: list[str | None] = [None] * len(decoders)
        streams = await self._start(bodies)
        try:
            async for piece in _decoded(decoders, streams):
                deltas[piece.index].append(piece.delta)
                token_ids[piece.index] += piece.token_ids
                reasons[piece.index] = piece.finish_reason
        finally:
            await streams.close()
        for i, decoder in enumerate(decoders):
            if reasons[i] is None:  # the engine stream ended without a finish reason
                deltas[i].append(decoder.finish())
                reasons[i] = final_finish_reason(None, decoder)
        return [CollectedChoice(*fields) for fields in zip(deltas, token_ids, reasons, strict=True)]

    # --- chat ---

    def _render_chat(self, request: ChatCompletionRequest) -> tuple[dict[str, Any], bool]:
        self.check_model(request.model)
        try:
            generate = self.renderer.render_chat(request.model_copy(update={"model": None}))
        except RequestError as exc:
            raise api_error(exc) from exc
        return generate, self.renderer.starts_in_reasoning(generate["token_ids"])

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any]:
        generate, in_reasoning = self._render_chat(request)
        options = decode_options(self.renderer, request)
        decoders = [
            self._decoder(options, in_reasoning, f"{generate['request_id']}:{i}") for i in range(request.n)
        ]
        collected = await self._collect(decoders, self._fan_out(generate, request.n, request.seed))
        choices = []
        for i, result in enumerate(collected):
            assembler = MessageAssembler()
            for delta in result.deltas:
                assembler.add(delta)
            token_ids = result.token_ids if request.return_token_ids else None
            choices.append(assembler.choice(i, result.finish_reason, token_ids))
        response: dict[str, Any] = {
            "id": generate["request_id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage_dict(len(generate["token_ids"]), sum(d.num_tokens for d in decoders)),
        }
        if request.return_token_ids:
            response["prompt_token_ids"] = generate["token_ids"]
        return response

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """Start the request (errors raise here) and return its SSE event stream."""
        generate, in_reasoning = self._render_chat(request)
        options = decode_options(self.renderer, request)
        streams = await self._start(self._fan_out(generate, request.n, request.seed))
        return self._chat_events(request, generate, options, in_reasoning, streams)

    async def _chat_events(
        self,
        request: ChatCompletionRequest,
        generate: dict[str, Any],
        options: DecodeOptions,
        in_reasoning: bool,
        streams: MergedStreams,
    ) -> AsyncIterator[str]:
        n = request.n
        decoders = [self._decoder(options, in_reasoning, f"{generate['request_id']}:{i}") for i in range(n)]
        role_sent = [False] * n
        include_usage = request.include_usage()
        base = {
            "id": generate["request_id"],
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        first_chunk = True
        try:
            async for index, token_ids, delta, reason in _decoded(decoders, streams):
                empty = not (delta.reasoning or delta.content or delta.tool_calls or delta.logprobs)
                if empty and role_sent[index] and reason is None:
                    continue
                event: dict[str, Any] = {
                    **base,
                    "choices": [
                        chunk_choice(
                            index,
                            delta,
                            role=not role_sent[index],
                            finish_reason=reason,
                            token_ids=token_ids if request.return_token_ids else None,
                        )
                    ],
                }
                role_sent[index] = True
                if first_chunk and request.return_token_ids:
                    event["prompt_token_ids"] = generate["token_ids"]
                first_chunk = False
                if include_usage:
                    event["usage"] = None
                yield _sse(event)
            if include_usage:
                usage = usage_dict(len(generate["token_ids"]), sum(d.num_tokens for d in decoders))
                yield _sse({**base, "choices": [], "usage": usage})
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            await streams.close()
        yield "data: [DONE]\n\n"

    def _decoder(self, options: DecodeOptions, in_reasoning: bool, salt: str) -> ChoiceDecoder:
        return ChoiceDecoder(
            self.renderer.tokenizer, options, starts_in_reasoning=in_reasoning, tool_id_salt=salt
        )

    # --- completions ---

    def _render_completion(self, request: CompletionRequest) -> list[dict[str, Any]]:
        self.check_model(request.model)
        try:
            return self.renderer.render_completion(request.model_copy(update={"model": None}))
        except RequestError as exc:
            raise api_error(exc) from exc

    def _completion_bodies(self, request: CompletionRequest, generates: list[dict[str, Any]]) -> list[dict]:
        bodies = []
        for generate in generates:
            bodies += self._fan_out(generate, request.n, request.seed)
        return bodies

    @staticmethod
    def _completion_options(request: CompletionRequest) -> DecodeOptions:
        return DecodeOptions(
            stop=request.stop_strings(),
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            reasoning=False,
            tools=False,
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
        )

    async def completion(self, request: CompletionRequest) -> dict[str, Any]:
        generates = self._render_completion(request)
        bodies = self._completion_bodies(request, generates)
        options = self._completion_options(request)
        decoders = [self._decoder(options, False, body["request_id"]) for body in bodies]
        collected = await self._collect(decoders, bodies)
        choices = []
        for i, result in enumerate(collected):
            logprobs = [entry for delta in result.deltas for entry in delta.logprobs or []]
            choice: dict[str, Any] = {
                "index": i,
                "text": "".join(delta.content for delta in result.deltas),
                "logprobs": _completion_logprobs(logprobs) if options.logprobs else None,
                "finish_reason": result.finish_reason,
            }
            if request.return_token_ids:
                choice["token_ids"] = result.token_ids
                choice["prompt_token_ids"] = generates[i // request.n]["token_ids"]
            choices.append(choice)
        prompt_tokens = sum(len(g["token_ids"]) for g in generates) * request.n
        return {
            "id": generates[0]["request_id"],
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage_dict(prompt_tokens, sum(d.num_tokens for d in decoders)),
        }

    async def completion_stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        generates = self._render_completion(request)
        bodies = self._completion_bodies(request, generates)
        streams = await self._start(bodies)
        return self._completion_events(request, generates, bodies, streams)

    async def _completion_events(
        self,
        request: CompletionRequest,
        generates: list[dict[str, Any]],
        bodies: list[dict[str, Any]],
        streams: MergedStreams,
    ) -> AsyncIterator[str]:
        options = self._completion_options(request)
        decoders = [self._decoder(options, False, body["request_id"]) for body in bodies]
        base = {
            "id": generates[0]["request_id"],
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        try:
            async for index, token_ids, delta, reason in _decoded(decoders, streams):
                if not delta.content and reason is None:
                    continue
                choice: dict[str, Any] = {
                    "index": index,
                    "text": delta.content,
                    "finish_reason": reason,
                    "logprobs": _completion_logprobs(delta.logprobs or []) if options.logprobs else None,
                }
                if request.return_token_ids:
                    choice["token_ids"] = token_ids
                event = {**base, "choices": [choice]}
                if request.include_usage():
                    event["usage"] = None
                yield _sse(event)
            if request.include_usage():
                prompt_tokens = sum(len(g["token_ids"]) for g in generates) * request.n
                usage = usage_dict(prompt_tokens, sum(d.num_tokens for d in decoders))
                yield _sse({**base, "choices": [], "usage": usage})
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            await streams.close()
        yield "data: [DONE]\n\n"


def _completion_logprobs(entries: list[dict]) -> dict[str, Any]:
    """Chat-style entries → the legacy completions logprobs object."""
    offset = 0
    text_offset = []
    for entry in entries:
        text_offset.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": text_offset,
    }
