"""The CPU render tier's HTTP API (shapes follow vLLM's `vllm launch render`).

- POST /v1/chat/completions/render: chat request → generate request (token_ids,
  sampling_params, block_hashes, features). `n` > 1 is the caller's to fan out (one
  generate request per choice, seeds seed+i), as the engine API takes one sequence.
  With `?derender_state=true` the answer also carries `derender_state`, the signed start
  of the way back for `/v1/derender/pieces` (the chat request never crosses again).
- POST /v1/completions/render: completions request → a list of generate requests.
- POST /v1/derender/pieces (splitserve's own, used by the proxy): `{pieces: [{state,
  index, token_ids, logprobs?, finish_reason?, final?}]}` → `{pieces: [{state, delta,
  finish_reason, stopped}]}`: several choices' new tokens in one call, O(new tokens). A
  piece with a null state continues the piece before it (the same choice's next engine
  chunk); its answer's state is null too, except for the last piece of such a run.
- POST /v1/chat/completions/derender: `{generate_response, chat_request}` → chat.completion;
  with `stream: true`, `{generate_chunk, stream_state, chat_request}` → `{chunk,
  stream_state}`. The state is an opaque signed string: pass back the one returned by the
  previous call, to any replica started with the same --state-key.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve.frontend.derender import Derenderer
from splitserve.frontend.local_client import models_response
from splitserve.frontend.render import Renderer
from splitserve.frontend.stream_state import StreamStateCodec
from splitserve.frontend.way_back import SignedStates, chat_seed, completion_seed, feed
from splitserve.protocol.derender_api import (
    DerenderChatRequest,
    DerenderChatStreamRequest,
    DerenderPiecesRequest,
)
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.frontend_client import DerenderPiece
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.openai_chunks import delta_to_wire
from splitserve.runtime.http_edge import (
    DEFAULT_MAX_BODY_BYTES,
    install_error_handlers,
    parse_model,
    read_json_body,
)


def _check_token_ids(token_ids: list[int], vocab_size: int, where: str) -> None:
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{where}: token ID {bad} is outside the vocabulary ({vocab_size})", where)


def _wants_state(raw: Request) -> bool:
    return raw.query_params.get("derender_state", "").lower() in ("1", "true")


def create_render_app(
    renderer: Renderer,
    state_key: bytes,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    codec = StreamStateCodec(state_key)
    derenderer = Derenderer(renderer, codec)
    states = SignedStates(renderer, codec)
    vocab = renderer.tokenizer.vocab_size
    app = FastAPI(title="splitserve render tier")
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_response(renderer)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(renderer.image_stats.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions/render")
    async def render_chat(raw: Request) -> JSONResponse:
        request = parse_model(ChatCompletionRequest, await read_json_body(raw, max_body_bytes))
        generate = renderer.render_chat(request)
        body = generate.to_wire(routing_hints=True)  # the render tier's edge
        if _wants_state(raw):
            body["derender_state"] = states.seed(chat_seed(renderer, request, generate))
        return JSONResponse(body)

    @app.post("/v1/completions/render")
    async def render_completion(raw: Request) -> JSONResponse:
        request = parse_model(CompletionRequest, await read_json_body(raw, max_body_bytes))
        bodies = []
        for generate in renderer.render_completion(request):
            body = generate.to_wire(routing_hints=True)  # the render tier's edge
            if _wants_state(raw):
                body["derender_state"] = states.seed(completion_seed(request, generate))
            bodies.append(body)
        return JSONResponse(bodies)

    @app.post("/v1/derender/pieces")
    async def derender_pieces(raw: Request) -> JSONResponse:
        request = parse_model(DerenderPiecesRequest, await read_json_body(raw, max_body_bytes))
        renderer.check_model(request.model)
        pieces = request.pieces
        if pieces and pieces[0].state is None:
            raise InvalidRequestError("the first piece needs a state", "pieces[0].state")
        answers = []
        decoder = None
        for i, body in enumerate(pieces):
            _check_token_ids(body.all_token_ids(), vocab, f"pieces[{i}]")
            start = decoder if body.state is None else states.decode(body.state, i)
            logprobs = None if body.logprobs is None else [e.model_dump() for e in body.logprobs]
            piece = DerenderPiece(start, body.index, body.token_ids, logprobs, body.finish_reason, body.final)
            decoder, delta, finish_reason, stopped = feed(renderer, start, piece)
            continued = i + 1 < len(pieces) and pieces[i + 1].state is None
            answers.append(
                {
                    "state": None if continued else states.encode(decoder),  # signed once per run
                    "delta": delta_to_wire(delta),
                    "finish_reason": finish_reason,
                    "stopped": stopped,
                }
            )
        return JSONResponse({"pieces": answers})

    @app.post("/v1/chat/completions/derender")
    async def derender_chat(raw: Request) -> JSONResponse:
        body = await read_json_body(raw, max_body_bytes)
        if isinstance(body, dict) and body.get("stream") is True:
            stream_request = parse_model(DerenderChatStreamRequest, body)
            renderer.check_model(stream_request.model)
            for choice in stream_request.generate_chunk.choices:
                _check_token_ids(choice.all_token_ids(), vocab, "generate_chunk")
            return JSONResponse(
                derenderer.chat_stream_chunk(
                    stream_request.generate_chunk.model_dump(),
                    stream_request.stream_state,
                    stream_request.chat_request,
                    prompt_token_ids=stream_request.prompt_token_ids,
                    prompt_tokens=stream_request.prompt_tokens,
                )
            )
        request = parse_model(DerenderChatRequest, body)
        renderer.check_model(request.model)
        for choice in request.generate_response.choices:
            _check_token_ids(choice.all_token_ids(), vocab, "generate_response")
        return JSONResponse(
            derenderer.chat_response(
                request.generate_response.model_dump(),
                request.chat_request,
                prompt_token_ids=request.prompt_token_ids,
                prompt_tokens=request.prompt_tokens,
            )
        )

    return app
