"""How the OpenAI layer and the proxy talk to an engine, wherever it runs.

Implementations: in-process (the collocated `serve`) and HTTP (`/inference/v1/generate`
of a `splitserve engine`, or of `vllm serve --enable-scale-out`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from splitserve.protocol.generate_request import GenerateRequest


class EngineClient(ABC):
    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """Run one generate request (as the render tier built it, routing hints included:
        an engine never gets them) and yield its streamed chunks in wire shape:
        `{request_id, choices: [{index, token_ids, finish_reason, logprobs?}], usage?,
        kv_transfer_params?, metrics?}`. The last
        chunk has a non-null finish_reason. Raises `APIError` for a rejected request.
        Closing the iterator early aborts the request."""

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests by ID; unknown IDs are ignored."""

    @abstractmethod
    async def check_health(self) -> bool:
        """True while the engine can take requests."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections or threads held by the client."""
