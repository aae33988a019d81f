"""Stall detection on a decode stream: a worker that is alive (its socket open) but makes
no progress (SIGSTOPped, wedged) would hold its streams forever. When a stream yields
nothing for `stall_timeout_s`, the worker's /health is probed with a short timeout: a
worker that answers is slow but healthy and keeps the stream; one that does not is
stalled, and the stream raises `DecodeStalled` so the proxy migrates it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from splitserve.protocol.errors import APIError

# How long a stalled worker's /health may take to answer. Not derived from the stall
# timeout: a tiny stall timeout must not make a busy but healthy worker look stalled.
PROBE_TIMEOUT_S = 2.0
# The abort sent to a stalled worker: it may never answer, and nobody waits for it.
ABORT_TIMEOUT_S = 2.0


class DecodeStalled(APIError):
    """503: the request resumes elsewhere like one whose worker died."""

    def __init__(self, url: str, stall_timeout_s: float) -> None:
        super().__init__(
            503,
            f"decode worker {url} stalled: no token for {stall_timeout_s:g} s and its /health "
            f"did not answer within {PROBE_TIMEOUT_S:g} s",
        )


async def watch_for_stall(
    stream: AsyncIterator[dict],
    stall_timeout_s: float,
    probe: Callable[[], Awaitable[bool]],
    on_probe: Callable[[], None],
    url: str,
) -> AsyncIterator[dict]:
    """The chunks of `stream`. After each `stall_timeout_s` without one, `probe()` (called
    after `on_probe()`); a False answer ends the stream with `DecodeStalled`. `stream` is
    closed however this ends."""
    pending: asyncio.Future = asyncio.ensure_future(anext(stream))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=stall_timeout_s)
            if not done:
                on_probe()
                if await probe() or pending.done():
                    continue  # slow but healthy (or the chunk arrived meanwhile)
                raise DecodeStalled(url, stall_timeout_s)
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(anext(stream))
    finally:
        if not pending.done():
            pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()
