"""The CPU render tier's HTTP API (shapes follow vLLM's `vllm launch render`).

- POST /v1/chat/completions/render: chat request → generate request (token_ids,
  sampling_params, block_hashes, features). `n` > 1 is the caller's to fan out (one
  generate request per choice, seeds seed+i), as the engine API takes one sequence.
- POST /v1/completions/render: completions request → a list of generate requests.
- POST /v1/chat/completions/derender: `{generate_response, chat_request}` → chat.completion;
  with `stream: true`, `{generate_chunk, stream_state, chat_request}` → `{chunk,
  stream_state}`. The state is an opaque signed string: pass back the one returned by the
  previous call, to any replica started with the same --state-key.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from splitserve.frontend.derender import Derenderer
from splitserve.frontend.derender_protocol import (
    DerenderChatRequest,
    DerenderChatStreamRequest,
    GenerateOutput,
)
from splitserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from splitserve.frontend.render import Renderer
from splitserve.frontend.stream_state import StreamStateCodec
from splitserve.server.errors import APIError, install_error_handlers
from splitserve.server.request_body import DEFAULT_MAX_BODY_BYTES, api_error, parse_model, read_json_body


def _check_token_ids(output: GenerateOutput, vocab_size: int, where: str) -> None:
    for choice in output.choices:
        bad = next((t for t in choice.all_token_ids() if t >= vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"{where}: token ID {bad} is outside the vocabulary ({vocab_size})", param=where
            )


def create_render_app(
    renderer: Renderer,
    state_key: bytes,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    name = renderer.model_name
    derenderer = Derenderer(renderer, StreamStateCodec(state_key))
    app = FastAPI(title="splitserve render tier")
    install_error_handlers(app)

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "splitserve",
                    "max_model_len": renderer.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions/render")
    async def render_chat(raw: Request) -> JSONResponse:
        request = parse_model(ChatCompletionRequest, await read_json_body(raw, max_body_bytes))
        check_model(request.model)
        try:
            return JSONResponse(renderer.render_chat(request.model_copy(update={"model": None})))
        except RequestError as exc:
            raise api_error(exc) from exc

    @app.post("/v1/completions/render")
    async def render_completion(raw: Request) -> JSONResponse:
        request = parse_model(CompletionRequest, await read_json_body(raw, max_body_bytes))
        check_model(request.model)
        try:
            return JSONResponse(renderer.render_completion(request.model_copy(update={"model": None})))
        except RequestError as exc:
            raise api_error(exc) from exc

    @app.post("/v1/chat/completions/derender")
    async def derender_chat(raw: Request) -> JSONResponse:
        body = await read_json_body(raw, max_body_bytes)
        streaming = isinstance(body, dict) and body.get("stream") is True
        vocab = renderer.tokenizer.vocab_size
        try:
            if streaming:
                stream_request = parse_model(DerenderChatStreamRequest, body)
                check_model(stream_request.model)
                _check_token_ids(stream_request.generate_chunk, vocab, "generate_chunk")
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
            check_model(request.model)
            _check_token_ids(request.generate_response, vocab, "generate_response")
            return JSONResponse(
                derenderer.chat_response(
                    request.generate_response.model_dump(),
                    request.chat_request,
                    prompt_token_ids=request.prompt_token_ids,
                    prompt_tokens=request.prompt_tokens,
                )
            )
        except RequestError as exc:
            raise api_error(exc) from exc

    return app
