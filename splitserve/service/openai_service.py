"""The OpenAI API as render → engine → derender, over a `FrontendClient` and an `EngineClient`.

One code path for `serve` (in-process frontend and engine) and the P/D proxy (the render
tier over HTTP, prefill/decode workers behind `PDEngineClient`). `n` fans out into n
engine requests (distinct IDs; seeds seed, seed+1, ... when a seed is given), merged as
they stream. Engine chunks that arrive while a derender call is in flight are decoded
together by the next call. A stop string ends a choice in derender and aborts its engine
request.

Each request's phases (render, the engine's time to first chunk as its client splits it,
waiting for later chunks, derender calls, sending) are measured as it runs
(`protocol/timeline.py`): handed to the `TimelineSink` (the proxy's histograms) and, when
the client asked (`timeline=True`), returned in the response's `splitserve_timeline`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from splitserve.protocol.engine_api import choice_logprobs
from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.errors import APIError
from splitserve.protocol.frontend_client import DerenderPiece, FrontendClient, RenderedPrompt
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.openai_chunks import (
    ChoiceDelta,
    MessageAssembler,
    chunk_choice,
    completion_logprobs,
    usage_dict,
)
from splitserve.protocol.timeline import DECODE, RENDER, SEND, TIMELINE_FIELD, RequestTimeline, TimelineSink
from splitserve.runtime.http_edge import SSE_DONE, sse_event
from splitserve.service.merged_streams import MergedStreams


class DecodedPiece(NamedTuple):
    index: int  # the choice
    token_ids: list[int]  # the engine tokens decoded into this piece (cut at a matched stop string)
    delta: ChoiceDelta
    finish_reason: str | None  # set on a choice's last piece


class CollectedChoice(NamedTuple):
    deltas: list[ChoiceDelta]
    token_ids: list[int]
    finish_reason: str
    cached_tokens: int  # prompt tokens the engine did not compute


class Choices(NamedTuple):
    """The engine requests of one API request (n per prompt) and their way-back states."""

    requests: list[GenerateRequest]
    states: list[Any]
    prompt_token_ids: list[list[int]]  # per choice


def fan_out(prompts: list[RenderedPrompt], n: int, seed: int | None) -> Choices:
    """Each choice's engine request gets an ID the server makes up: the client's
    `request_id` is only echoed as the response's `id`, so no client can collide with
    (or abort, or hijack the KV of) another's request, and any ID up to the API's limit
    of 256 characters works behind the P/D proxy's suffixes."""
    requests, states, prompt_ids = [], [], []
    for prompt in prompts:
        generate = prompt.generate
        for i in range(n):
            sampling_params = generate.sampling_params
            if n > 1 and seed is not None:
                sampling_params = dataclasses.replace(sampling_params, seed=seed + i)
            requests.append(
                dataclasses.replace(
                    generate,
                    request_id=f"req-{uuid.uuid4().hex}",
                    stream=True,
                    sampling_params=sampling_params,
                )
            )
            states.append(prompt.state)
            prompt_ids.append(list(generate.token_ids))
    return Choices(requests, states, prompt_ids)


def _pieces(batch: list[tuple[int, dict]], states: list[Any], done: list[bool]) -> list[DerenderPiece]:
    """A batch of engine chunks → one piece per chunk, grouped by choice in arrival order;
    a choice's later pieces continue its first (state None), so one derender call serves
    the whole batch while each chunk keeps its own delta."""
    by_choice: dict[int, list[DerenderPiece]] = {}
    for index, chunk in batch:
        for raw in chunk.get("choices") or []:
            token_ids = list(raw.get("token_ids") or [])
            reason = raw.get("finish_reason")
            if done[index] or not (token_ids or reason is not None):
                continue
            run = by_choice.setdefault(index, [])
            state = None if run else states[index]
            final = reason is not None
            run.append(DerenderPiece(state, index, token_ids, choice_logprobs(raw), reason, final))
    return [piece for run in by_choice.values() for piece in run]


class OpenAIService:
    def __init__(
        self, frontend: FrontendClient, engine: EngineClient, timeline_sink: TimelineSink | None = None
    ) -> None:
        self.frontend = frontend
        self.engine = engine
        self.timeline_sink = timeline_sink

    async def close(self) -> None:
        await self.engine.close()
        await self.frontend.close()

    async def _start(self, requests: list[GenerateRequest], timeline: RequestTimeline) -> MergedStreams:
        started = time.monotonic()
        streams = MergedStreams([self.engine.generate(request) for request in requests])
        await streams.start()
        timeline.first_chunk(time.monotonic() - started)
        return streams

    async def _render(self, render: Any, timeline: RequestTimeline) -> Any:
        started = time.monotonic()
        rendered = await render
        timeline.add(RENDER, time.monotonic() - started)
        return rendered

    async def _derender(self, pieces: list[DerenderPiece], timeline: RequestTimeline) -> list[Any]:
        started = time.monotonic()
        results = await self.frontend.derender(pieces)
        timeline.derender_call(time.monotonic() - started)
        return results

    async def _decoded(
        self, states: list[Any], streams: MergedStreams, timeline: RequestTimeline
    ) -> AsyncIterator[DecodedPiece]:
        """Each choice's engine tokens through the way back, a batch per derender call. A
        choice ends on the engine's finish reason or on a stop string, which aborts that
        engine request early. The time spent waiting for the engine, in derender and in
        the consumer (sending) goes to the timeline."""
        states = list(states)
        done = [False] * len(states)
        while True:
            waited = time.monotonic()
            batch = await streams.next_batch()
            timeline.add(DECODE, time.monotonic() - waited)
            if not batch:
                break
            pieces = _pieces(batch, states, done)
            if not pieces:
                continue
            for piece, result in zip(pieces, await self._derender(pieces, timeline), strict=True):
                if done[piece.index]:
                    continue  # ended by a stop string in an earlier chunk of this batch
                if result.state is not None:
                    states[piece.index] = result.state
                if result.finish_reason is not None:
                    done[piece.index] = True
                    if result.stopped:
                        streams.stop(piece.index)
                token_ids = piece.token_ids[: result.delta.num_tokens]
                handed = time.monotonic()
                yield DecodedPiece(piece.index, token_ids, result.delta, result.finish_reason)
                timeline.add(SEND, time.monotonic() - handed)
        # engine streams that ended without a finish reason: flush their parsers
        rest = [DerenderPiece(states[i], i, [], None, None, True) for i in range(len(states)) if not done[i]]
        if rest:
            for piece, result in zip(rest, await self._derender(rest, timeline), strict=True):
                yield DecodedPiece(piece.index, [], result.delta, result.finish_reason)
        timeline.engine(streams.engine_phases[0])

    async def _collect(self, choices: Choices, timeline: RequestTimeline) -> list[CollectedChoice]:
        """Run the engine requests to the end (non-streaming) through the way back."""
        deltas: list[list[ChoiceDelta]] = [[] for _ in choices.requests]
        token_ids: list[list[int]] = [[] for _ in choices.requests]
        reasons: list[str] = ["stop"] * len(choices.requests)
        streams = await self._start(choices.requests, timeline)
        try:
            async for piece in self._decoded(choices.states, streams, timeline):
                deltas[piece.index].append(piece.delta)
                token_ids[piece.index] += piece.token_ids
                if piece.finish_reason is not None:
                    reasons[piece.index] = piece.finish_reason
        finally:
            await streams.close()
        fields = zip(deltas, token_ids, reasons, streams.cached_tokens, strict=True)
        return [CollectedChoice(*choice) for choice in fields]

    # --- chat ---

    async def chat(self, request: ChatCompletionRequest, *, timeline: bool = False) -> dict[str, Any]:
        phases = RequestTimeline(self.timeline_sink)
        prompt = await self._render(self.frontend.render_chat(request), phases)
        generate = prompt.generate
        collected = await self._collect(fan_out([prompt], request.n, request.seed), phases)
        choices = []
        for i, result in enumerate(collected):
            assembler = MessageAssembler()
            for delta in result.deltas:
                assembler.add(delta)
            token_ids = result.token_ids if request.return_token_ids else None
            choices.append(assembler.choice(i, result.finish_reason, token_ids))
        response: dict[str, Any] = {
            "id": generate.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": generate.model,
            "choices": choices,
            # the prompt is counted once, so its cached part is the first choice's
            "usage": _usage(collected, len(generate.token_ids), collected[0].cached_tokens),
        }
        if request.return_token_ids:
            response["prompt_token_ids"] = list(generate.token_ids)
        return _with_timeline(response, phases, timeline)

    async def chat_stream(
        self, request: ChatCompletionRequest, *, timeline: bool = False
    ) -> AsyncIterator[str]:
        """Start the request (errors raise here) and return its SSE event stream."""
        phases = RequestTimeline(self.timeline_sink)
        prompt = await self._render(self.frontend.render_chat(request), phases)
        choices = fan_out([prompt], request.n, request.seed)
        streams = await self._start(choices.requests, phases)
        events = self._chat_events(request, prompt.generate, choices, streams, phases)
        return _sse_stream(_with_final_timeline(events, phases, timeline), streams)

    async def _chat_events(
        self,
        request: ChatCompletionRequest,
        generate: GenerateRequest,
        choices: Choices,
        streams: MergedStreams,
        phases: RequestTimeline,
    ) -> AsyncIterator[dict[str, Any]]:
        role_sent = [False] * len(choices.requests)
        num_tokens = 0
        include_usage = request.include_usage()
        base = {
            "id": generate.request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": generate.model,
        }
        first_chunk = True
        # the token IDs of a piece that made no event (its text held back by the parsers)
        # travel with the choice's next event: every generated ID reaches the client once
        held: list[list[int]] = [[] for _ in choices.requests]
        async for index, token_ids, delta, reason in self._decoded(choices.states, streams, phases):
            num_tokens += delta.num_tokens
            held[index] += token_ids
            empty = not (delta.reasoning or delta.content or delta.tool_calls or delta.logprobs)
            if empty and role_sent[index] and reason is None:
                continue
            choice = chunk_choice(
                index,
                delta,
                role=not role_sent[index],
                finish_reason=reason,
                token_ids=held[index] if request.return_token_ids else None,
            )
            held[index] = []
            event: dict[str, Any] = {**base, "choices": [choice]}
            role_sent[index] = True
            if first_chunk and request.return_token_ids:
                event["prompt_token_ids"] = list(generate.token_ids)
            first_chunk = False
            if include_usage:
                event["usage"] = None
            yield event
        if include_usage:
            usage = usage_dict(len(generate.token_ids), num_tokens, streams.cached_tokens[0])
            yield {**base, "choices": [], "usage": usage}

    # --- completions ---

    async def completion(self, request: CompletionRequest, *, timeline: bool = False) -> dict[str, Any]:
        phases = RequestTimeline(self.timeline_sink)
        prompts = await self._render(self.frontend.render_completion(request), phases)
        choices = fan_out(prompts, request.n, request.seed)
        collected = await self._collect(choices, phases)
        result_choices = []
        for i, result in enumerate(collected):
            logprobs = [entry for delta in result.deltas for entry in delta.logprobs or []]
            choice: dict[str, Any] = {
                "index": i,
                "text": "".join(delta.content for delta in result.deltas),
                "logprobs": completion_logprobs(logprobs) if request.logprobs is not None else None,
                "finish_reason": result.finish_reason,
            }
            if request.return_token_ids:
                choice["token_ids"] = result.token_ids
                choice["prompt_token_ids"] = choices.prompt_token_ids[i]
            result_choices.append(choice)
        response = {
            "id": prompts[0].generate.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": prompts[0].generate.model,
            "choices": result_choices,
            "usage": _usage(
                collected,
                sum(len(ids) for ids in choices.prompt_token_ids),
                sum(c.cached_tokens for c in collected),
            ),
        }
        return _with_timeline(response, phases, timeline)

    async def completion_stream(
        self, request: CompletionRequest, *, timeline: bool = False
    ) -> AsyncIterator[str]:
        phases = RequestTimeline(self.timeline_sink)
        prompts = await self._render(self.frontend.render_completion(request), phases)
        choices = fan_out(prompts, request.n, request.seed)
        streams = await self._start(choices.requests, phases)
        events = self._completion_events(request, prompts, choices, streams, phases)
        return _sse_stream(_with_final_timeline(events, phases, timeline), streams)

    async def _completion_events(
        self,
        request: CompletionRequest,
        prompts: list[RenderedPrompt],
        choices: Choices,
        streams: MergedStreams,
        phases: RequestTimeline,
    ) -> AsyncIterator[dict[str, Any]]:
        num_tokens = 0
        base = {
            "id": prompts[0].generate.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": prompts[0].generate.model,
        }
        held: list[list[int]] = [[] for _ in choices.requests]  # as in chat: IDs of pieces with no event
        async for index, token_ids, delta, reason in self._decoded(choices.states, streams, phases):
            num_tokens += delta.num_tokens
            held[index] += token_ids
            if not delta.content and reason is None:
                continue
            choice: dict[str, Any] = {
                "index": index,
                "text": delta.content,
                "finish_reason": reason,
                "logprobs": None if request.logprobs is None else completion_logprobs(delta.logprobs or []),
            }
            if request.return_token_ids:
                choice["token_ids"] = held[index]
            held[index] = []
            event = {**base, "choices": [choice]}
            if request.include_usage():
                event["usage"] = None
            yield event
        if request.include_usage():
            prompt_tokens = sum(len(ids) for ids in choices.prompt_token_ids)
            usage = usage_dict(prompt_tokens, num_tokens, sum(streams.cached_tokens))
            yield {**base, "choices": [], "usage": usage}


def _usage(collected: list[CollectedChoice], prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    completion_tokens = sum(d.num_tokens for result in collected for d in result.deltas)
    return usage_dict(prompt_tokens, completion_tokens, cached_tokens)


def _with_timeline(response: dict[str, Any], phases: RequestTimeline, wanted: bool) -> dict[str, Any]:
    finished = phases.finish()
    if wanted:
        response[TIMELINE_FIELD] = finished
    return response


async def _with_final_timeline(
    events: AsyncIterator[dict[str, Any]], phases: RequestTimeline, wanted: bool
) -> AsyncIterator[dict[str, Any]]:
    """The events as they come; when the client asked, the timeline in the last one: the
    usage chunk (`choices: []`, always last), or a chunk of that shape of its own."""
    usage_event: dict[str, Any] | None = None
    base: dict[str, Any] = {}
    async for event in events:
        if event.get("choices"):
            base = event
            yield event
        else:
            usage_event = event
    finished = phases.finish()
    if usage_event is not None:
        yield {**usage_event, TIMELINE_FIELD: finished} if wanted else usage_event
    elif wanted and base:
        header = {key: base[key] for key in ("id", "object", "created", "model")}
        yield {**header, "choices": [], TIMELINE_FIELD: finished}


async def _sse_stream(events: AsyncIterator[dict[str, Any]], streams: MergedStreams) -> AsyncIterator[str]:
    """Events as SSE; an error after the stream started becomes an error event. The engine
    requests end with the stream, however it ends."""
    try:
        async for event in events:
            yield sse_event(event)
    except APIError as exc:
        yield sse_event(exc.body())
    finally:
        await streams.close()
    yield SSE_DONE
