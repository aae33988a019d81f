"""Concurrent callers sharing calls: items submitted while `max_in_flight` calls are out
wait and leave together in the next call.

The P/D proxy decodes every engine token of every stream through the render tier. One
HTTP call per token per stream costs a round trip each; with the batcher, the streams of
one proxy share a few calls in flight, and each call carries whatever arrived meanwhile.

A caller's group larger than one call may carry (`max_items`) is sent as consecutive
parts, each waiting for the one before; `link` lets a part's first item depend on the
result of the item just before it (a derender piece that continues the previous one
takes that piece's returned state).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class CallBatcher(Generic[Item, Result]):
    def __init__(
        self,
        send: Callable[[list[Item]], Awaitable[Sequence[Result]]],
        *,
        max_in_flight: int = 4,
        max_items: int = 1024,
        link: Callable[[Item, Result], Item] | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self._send = send  # results in the order of the items
        self._max_in_flight = max_in_flight
        self._max_items = max_items
        self._link = link  # (first item of a part, result of the item before it) -> the item to send
        self._waiting: list[tuple[list[Item], asyncio.Future[list[Result]]]] = []
        self._calls: set[asyncio.Task[None]] = set()

    async def call(self, items: list[Item]) -> list[Result]:
        if len(items) <= self._max_items:
            return await self._call_part(items)
        results: list[Result] = []
        for start in range(0, len(items), self._max_items):
            part = items[start : start + self._max_items]
            if results and self._link is not None:
                part = [self._link(part[0], results[-1]), *part[1:]]
            results += await self._call_part(part)
        return results

    async def _call_part(self, items: list[Item]) -> list[Result]:
        future: asyncio.Future[list[Result]] = asyncio.get_running_loop().create_future()
        self._waiting.append((items, future))
        self._start_calls()
        return await future

    def _start_calls(self) -> None:
        while self._waiting and len(self._calls) < self._max_in_flight:
            batch, count = [], 0
            while self._waiting and (not batch or count + len(self._waiting[0][0]) <= self._max_items):
                items, future = self._waiting.pop(0)
                if not future.done():  # a caller that gave up (cancelled) sends nothing
                    batch.append((items, future))
                    count += len(items)
            if not batch:
                continue
            task = asyncio.create_task(self._run(batch))
            self._calls.add(task)
            task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        self._start_calls()

    async def _run(self, batch: list[tuple[list[Item], asyncio.Future[list[Result]]]]) -> None:
        try:
            results = list(await self._send([item for items, _ in batch for item in items]))
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        start = 0
        for items, future in batch:
            if not future.done():
                future.set_result(results[start : start + len(items)])
            start += len(items)

    async def close(self) -> None:
        for task in self._calls:
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
