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


class ConnectFailureSafeTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, with one library race turned into the connect failure it is."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            # A peer that resets a connection as it is accepted (a replica being killed)
            # can close the transport before httpcore reads its TLS info; under uvloop the
            # closed transport has no socket and anyio calls getpeername() on None. Nothing
            # was sent yet, so callers must see a connect failure, not an internal error.
            if "getpeername" not in str(exc):
                raise
            raise httpx.ConnectError(f"connection reset while opening: {exc}", request=request) from exc


def pooled_client(
    *, read_timeout_s: float | None, max_connections: int | None = None, keepalive: int = 20
) -> httpx.AsyncClient:
    """An AsyncClient for another tier: keep-alive connections that expire before the
    server's, `keepalive` of them kept idle (httpcore scans its whole pool on every
    request, so keep pools small). Every request carries the deployment's internal token."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=keepalive,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    return httpx.AsyncClient(
        headers=internal_headers(),
        timeout=httpx.Timeout(read_timeout_s, connect=10.0),
        transport=ConnectFailureSafeTransport(limits=limits),
    )
