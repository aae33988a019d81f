"""Concurrent callers share calls: what arrives while calls are in flight leaves together."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.runtime.call_batcher import CallBatcher


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


def test_a_group_larger_than_one_call_is_sent_as_linked_parts_in_order():
    """One caller's 1,500 items with max_items=1024: two calls, the second after the first,
    its first item linked to the result before it (as a derender piece continuing the last
    piece of the previous call takes that piece's state)."""
    calls: list[list[tuple[int, int | None]]] = []

    async def send(items: list[tuple[int, int | None]]) -> list[int]:
        calls.append(items)
        assert items[0][1] is not None, "a call's first item needs what came before"
        await asyncio.sleep(0)
        return [value for value, _ in items]

    def link(item: tuple[int, int | None], before: int) -> tuple[int, int | None]:
        return (item[0], before) if item[1] is None else item

    async def run() -> list[int]:
        batcher = CallBatcher(send, max_in_flight=4, max_items=1024, link=link)
        group = [(0, -1)] + [(i, None) for i in range(1, 1500)]
        results = await batcher.call(group)
        await batcher.close()
        return results

    results = asyncio.run(run())
    assert results == list(range(1500))
    assert [len(call) for call in calls] == [1024, 476]
    assert calls[1][0] == (1024, 1023)  # linked to the last result of the first call


def test_max_items_must_be_positive():
    with pytest.raises(ValueError, match="max_items"):
        CallBatcher(lambda items: asyncio.sleep(0, items), max_items=0)
