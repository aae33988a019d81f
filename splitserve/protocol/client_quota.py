"""Per-client quotas on the public API: one client (by its address) cannot take every
KV reservation of a P/D deployment while others wait.

Each request the proxy serves on a generation path holds at most one decode reservation
and one prefill hold while it is in flight, so bounding a client's requests in flight
(`--max-in-flight-per-client`) bounds its reservations. Past the bound its next request
gets 429 with `Retry-After` and an OpenAI error body (`client_quota_exceeded`) at once;
other clients are served as before. A request stops counting when its response has been
sent or its client has gone (the server then aborts it, releasing its reservations).

A client is its TCP peer address: the deployment has one API key, shared by its
clients, so the key does not tell them apart. Behind a load balancer every client has
the balancer's address; raise the bound, or quota at the balancer.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.protocol.drain import RETRY_AFTER_S
from splitserve.protocol.errors import error_body

# Generation requests: what reserves KV in a P/D deployment.
QUOTA_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class ClientQuota:
    """ASGI wrapper: at most `max_per_client` requests on QUOTA_PATHS in flight per client
    address (0: no bound). Runs on one event loop, so plain counters suffice."""

    def __init__(self, app: Any, max_per_client: int) -> None:
        self.app = app
        self.max_per_client = max_per_client
        self._in_flight: dict[str, int] = {}

    def in_flight(self, client: str) -> int:
        return self._in_flight.get(client, 0)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.max_per_client <= 0 or scope.get("path") not in QUOTA_PATHS:
            await self.app(scope, receive, send)
            return
        peer = scope.get("client")
        client = str(peer[0]) if peer else "unknown"
        if self.in_flight(client) >= self.max_per_client:
            await _refuse(send, self.max_per_client)
            return
        self._in_flight[client] = self.in_flight(client) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self._in_flight[client] - 1
            if left:
                self._in_flight[client] = left
            else:
                del self._in_flight[client]


async def _refuse(send: Any, limit: int) -> None:
    message = f"this client has {limit} requests in flight, its limit; retry when one has finished"
    payload = json.dumps(error_body(429, message, code="client_quota_exceeded")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
