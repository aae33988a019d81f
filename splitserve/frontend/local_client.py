"""The in-process `FrontendClient`: the collocated server renders and derenders here, with
the same functions the render tier serves over HTTP."""

from __future__ import annotations

import time
from typing import Any

from splitserve.frontend.render import Renderer
from splitserve.frontend.way_back import chat_seed, completion_seed, feed
from splitserve.protocol.frontend_client import (
    DerenderedPiece,
    DerenderPiece,
    FrontendClient,
    RenderedPrompt,
)
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest


def models_response(renderer: Renderer) -> dict[str, Any]:
    """`/v1/models`: the one model this frontend serves. As in vLLM's entries, `root` is
    where the model lives on the render host (its directory or GGUF file) and `parent` is
    null: clients such as `splitserve bench` find the tokenizer through `root`."""
    return {
        "object": "list",
        "data": [
            {
                "id": renderer.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "splitserve",
                "root": renderer.config.model,
                "parent": None,
                "max_model_len": renderer.max_model_len,
            }
        ],
    }


class LocalFrontendClient(FrontendClient):
    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer

    async def models(self) -> dict[str, Any]:
        return models_response(self.renderer)

    async def render_chat(self, request: ChatCompletionRequest) -> RenderedPrompt:
        generate = self.renderer.render_chat(request)
        seed = chat_seed(self.renderer, request, generate)
        return RenderedPrompt(generate, seed)

    async def render_completion(self, request: CompletionRequest) -> list[RenderedPrompt]:
        return [
            RenderedPrompt(generate, completion_seed(request, generate))
            for generate in self.renderer.render_completion(request)
        ]

    async def derender(self, pieces: list[DerenderPiece]) -> list[DerenderedPiece]:
        results: list[DerenderedPiece] = []
        for piece in pieces:
            state = results[-1].state if piece.state is None else piece.state
            results.append(feed(self.renderer, state, piece))
        return results
