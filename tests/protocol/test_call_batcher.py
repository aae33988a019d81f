"""Concurrent callers share calls: what arrives while calls are in flight leaves together."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.protocol.call_batcher import CallBatcher


def test_callers_share_calls_and_get_their_own_results():
    calls: list[list[int]] = []

    async def send(items: list[int]) -> list[int]:
        calls.append(items)
        await asyncio.sleep(0.01)
        return [item * 10 for item in items]

    async def run() -> list[list[int]]:
        batcher = CallBatcher(send, max_in_flight=1)
        results = await asyncio.gather(*(batcher.call([i, i + 100]) for i in range(20)))
        await batcher.close()
        return results

    results = asyncio.run(run())
    assert results == [[i * 10, (i + 100) * 10] for i in range(20)]
    assert calls[0] == [0, 100] and len(calls) == 2  # the other 19 callers waited and left together
    sent = sorted(item for call in calls for item in call)
    assert sent == sorted(i + d for i in range(20) for d in (0, 100))


def test_a_failed_call_fails_its_callers_only_and_the_next_call_runs():
    async def send(items: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        if 13 in items:
            raise ValueError("bad batch")
        return items

    async def run() -> tuple[object, list[int]]:
        batcher = CallBatcher(send, max_in_flight=1, max_items=1)
        failed = asyncio.gather(batcher.call([13]), return_exceptions=True)
        fine = batcher.call([7])
        results = await asyncio.gather(failed, fine)
        await batcher.close()
        return results[0][0], results[1]

    error, fine = asyncio.run(run())
    assert isinstance(error, ValueError) and fine == [7]


def test_a_caller_that_gives_up_sends_nothing():
    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int]:
        sent.append(items)
        await asyncio.sleep(0.02)
        return items

    async def run() -> list[int]:
        batcher = CallBatcher(send, max_in_flight=1)
        first = asyncio.ensure_future(batcher.call([1]))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(batcher.call([2]))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        result = await first
        assert await batcher.call([3]) == [3]
        await batcher.close()
        return result

    assert asyncio.run(run()) == [1]
    assert sent == [[1], [3]]
