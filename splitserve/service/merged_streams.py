"""Several engine streams (the n choices of one request) read concurrently as one, in
batches: what arrived while the reader was busy comes together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from splitserve.protocol.engine_api import prompt_cached_tokens
from splitserve.protocol.timeline import engine_phases

_DONE = object()


class MergedStreams:
    """Several engine streams read concurrently, yielded as (stream index, chunk)."""

    def __init__(self, streams: list[AsyncIterator[dict]]) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self._remaining = len(self._tasks)
        self._head: list[tuple[int, dict]] = []
        # per stream: the prompt tokens its engine did not compute (from its usage)
        self.cached_tokens: list[int] = [0] * len(streams)
        # per stream: the engine's phases before its first chunk (protocol/timeline.py)
        self.engine_phases: list[dict[str, float] | None] = [None] * len(streams)

    async def _pump(self, index: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for chunk in stream:
                cached = prompt_cached_tokens(chunk)
                if cached is not None:
                    self.cached_tokens[index] = cached
                if "metrics" in chunk:  # a final chunk: how the engine spent its time to first token
                    self.engine_phases[index] = engine_phases(chunk) or self.engine_phases[index]
                self._queue.put_nowait((index, chunk))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]  # aborts an unfinished request
            self._queue.put_nowait((index, _DONE))

    async def _next(self) -> tuple[int, dict] | None:
        while self._remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        return None

    async def start(self) -> None:
        """Wait for the first chunk, so that a rejected request raises here (an HTTP
        error) rather than in the middle of a stream."""
        try:
            first = await self._next()
        except BaseException:
            await self.close()
            raise
        if first is not None:
            self._head.append(first)

    def stop(self, index: int) -> None:
        """Stop reading one stream (its engine request is aborted)."""
        self._tasks[index].cancel()

    async def next_batch(self) -> list[tuple[int, dict]]:
        """Every chunk that has arrived, waiting for one if none has; [] at the end. While
        the caller works on one batch (a derender call), the next one accumulates."""
        batch, self._head = self._head, []
        if not batch:
            first = await self._next()
            if first is None:
                return []
            batch.append(first)
        while self._remaining and not self._queue.empty():
            index, item = self._queue.get_nowait()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                batch.append((index, item))
        return batch

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
