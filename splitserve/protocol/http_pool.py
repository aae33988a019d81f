"""The one way tiers open HTTP connection pools to each other."""

from __future__ import annotations

import httpx

from splitserve.runtime.access import internal_headers

# Every tier's uvicorn keeps an idle keep-alive connection this long (its default, 5 s,
# made a proxy idle for a few seconds open new TCP connections for the next burst)...
SERVER_KEEPALIVE_S = 75
# ... and a client drops one sooner: one reused as the server closes it reads a reset
# (httpx.ReadError) instead of an answer.
KEEPALIVE_EXPIRY_S = 60.0


def pooled_client(
    *, read_timeout_s: float | None, max_connections: int | None = None, keepalive: int = 20
) -> httpx.AsyncClient:
    """An AsyncClient for another tier: keep-alive connections that expire before the
    server's, `keepalive` of them kept idle (httpcore scans its whole pool on every
    request, so keep pools small). Every request carries the deployment's internal token."""
    return httpx.AsyncClient(
        headers=internal_headers(),
        timeout=httpx.Timeout(read_timeout_s, connect=10.0),
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=keepalive,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        ),
    )
