"""How the OpenAI service talks to the render tier (the frontend), wherever it runs.

Implementations: in-process (`frontend/local_client.py`, the collocated `serve`) and HTTP
(`runtime/http_frontend_client.py`, the P/D proxy in front of `splitserve render`). The
request crosses to the frontend once, at render; what the way back needs later (decode
options, whether the output starts in reasoning, the parsers' state) travels in an opaque
per-choice `state`: an object in process, a signed string over HTTP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.openai_chunks import ChoiceDelta


class RenderedPrompt(NamedTuple):
    generate: GenerateRequest  # the engine's generate request, routing hints included
    state: Any  # the way back's starting state for every choice of this prompt


class DerenderPiece(NamedTuple):
    """New engine output of one choice, to be turned into a delta."""

    # From render, or this choice's last derender; None: this piece continues the piece
    # just before it in the same call (the same choice's earlier engine chunk).
    state: Any
    index: int  # the choice
    token_ids: list[int]
    logprobs: list[dict] | None  # the engine's logprob entries for token_ids
    finish_reason: str | None  # the engine's
    final: bool  # the engine stream of this choice ended: flush and close the parsers


class DerenderedPiece(NamedTuple):
    state: Any  # pass it with this choice's next piece (None when the next piece continues it)
    delta: ChoiceDelta  # num_tokens: engine tokens consumed (none after a stop string)
    finish_reason: str | None  # set when the choice ended (engine finish, or a stop string)
    stopped: bool  # a stop string ended the choice: its engine request can be aborted


class FrontendClient(ABC):
    @abstractmethod
    async def models(self) -> dict[str, Any]:
        """The `/v1/models` answer."""

    @abstractmethod
    async def render_chat(self, request: ChatCompletionRequest) -> RenderedPrompt:
        """One generate request for the chat (the caller fans out n). Raises `APIError`."""

    @abstractmethod
    async def render_completion(self, request: CompletionRequest) -> list[RenderedPrompt]:
        """One generate request per prompt. Raises `APIError`."""

    @abstractmethod
    async def derender(self, pieces: list[DerenderPiece]) -> list[DerenderedPiece]:
        """Decode new tokens of several choices at once, in order: one result per piece,
        so each engine chunk stays its own delta (and its own stream event)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections held by the client."""
