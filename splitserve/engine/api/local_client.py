"""The in-process `EngineClient`: `/inference/v1/generate` semantics over an `AsyncEngine`.

The engine app is built on it too, so the HTTP API and the collocated server share one
implementation of validation, chunk shapes, abort and metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from splitserve.engine.api.generate import ChunkBuilder
from splitserve.engine.api.metrics import EngineMetrics
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import DEFAULT_MAX_PIXEL_BYTES, GenerateRequest


class LocalEngineClient(EngineClient):
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: EngineMetrics | None = None,
        max_model_len: int | None = None,
        max_pixel_bytes: int = DEFAULT_MAX_PIXEL_BYTES,  # decoded image pixels per request
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.max_pixel_bytes = max_pixel_bytes
        self._in_flight: set[str] = set()

    def parse(self, body: object) -> GenerateRequest:
        """Validate a generate body (`APIError` on bad input)."""
        try:
            return GenerateRequest.from_wire(
                body, max_model_len=self.max_model_len, max_pixel_bytes=self.max_pixel_bytes
            )
        except APIError as exc:
            self._count_rejected(exc.status)
            raise

    def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        # A client always gets usage on the final chunk, whatever stream_options say.
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        try:
            request = request.at_engine(
                max_model_len=self.max_model_len, max_pixel_bytes=self.max_pixel_bytes
            )
        except APIError as exc:
            self._count_rejected(exc.status)
            raise
        async for chunk in self.stream(request, force_usage=True):
            yield chunk

    async def stream(self, request: GenerateRequest, *, force_usage: bool = False) -> AsyncIterator[dict]:
        """Run a parsed request, yielding wire chunks. Rejections (`APIError`) come before
        the first chunk; closing the iterator early aborts the request and frees its blocks."""
        if not self.engine.is_running:
            raise APIError(503, "engine is not running")
        if request.request_id in self._in_flight:
            self._count_rejected(400)
            raise APIError(
                400,
                f"request_id {request.request_id!r} is already in flight",
                param="request_id",
                code="duplicate_request_id",
            )
        self._in_flight.add(request.request_id)
        tracker = self.metrics.request_tracker() if self.metrics else None
        builder = ChunkBuilder(request)
        outputs = self.engine.generate(request)
        finished = False
        try:
            try:
                first = await outputs.__anext__()
            except APIError as exc:  # the engine refused it (413, out of vocabulary, ...)
                self._count_rejected(exc.status)
                raise
            except StopAsyncIteration:
                first = None
            output: RequestOutput | None = first
            while output is not None:
                if tracker:
                    tracker.on_output(
                        output.new_token_ids,
                        output.metrics,
                        output.finished,
                        output.finish_reason,
                        output.num_prompt_tokens,
                    )
                finished = output.finished
                if output.new_token_ids or finished or request.continuous_usage:
                    yield builder.chunk(output, force_usage=force_usage)
                if finished:
                    break
                output = await anext(outputs, None)
            if not finished:
                # The engine ended the stream without a final output (aborted elsewhere).
                finished = True
                if tracker:
                    tracker.on_aborted()
                yield builder.chunk(_aborted_output(request, builder), force_usage=force_usage)
        finally:
            self._in_flight.discard(request.request_id)
            if not finished:
                if tracker:
                    tracker.on_aborted()
                await outputs.aclose()  # aborts the request in the engine, freeing its blocks

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight

    async def abort(self, request_ids: list[str]) -> None:
        self.abort_known(request_ids)

    def abort_known(self, request_ids: list[str]) -> list[str]:
        """Abort the given requests; returns the IDs the engine knew."""
        return [rid for rid in request_ids if self.engine.abort(rid)]

    async def check_health(self) -> bool:
        return self.engine.is_running

    def _count_rejected(self, status: int) -> None:
        if self.metrics:
            self.metrics.on_rejected(status)


def _aborted_output(request: GenerateRequest, builder: ChunkBuilder) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_logprobs=None,
        finished=True,
        finish_reason="abort",
        num_prompt_tokens=builder.num_prompt_tokens,
        num_cached_tokens=builder.num_cached_tokens or 0,
        kv_transfer_params=None,
        metrics=None,
    )
