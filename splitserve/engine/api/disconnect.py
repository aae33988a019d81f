"""A handler's work raced against its client going away: once the request body is read,
the next ASGI message is `http.disconnect`, and nobody waits for the answer any more."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from starlette.types import Receive

# The status of an answer nobody receives (the client left first), as nginx logs it.
CLIENT_GONE_STATUS = 499


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def first_of(work: Awaitable[Any], receive: Receive) -> tuple[bool, Any]:
    """Run `work` until it finishes or the client disconnects; (disconnected, result)."""
    work_task = asyncio.ensure_future(work)
    listen_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, listen_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listen_task.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.gather(work_task, listen_task, return_exceptions=True)
    if work_task.cancelled():
        return True, None
    return False, work_task.result()
