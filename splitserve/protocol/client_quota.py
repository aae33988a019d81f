"""Per-client quotas on the public API: one client cannot take every KV reservation, or
every KV block, of a P/D deployment while others wait.

Two bounds per client, each off at 0:
- requests in flight on the generation paths (`--max-in-flight-per-client`): each holds
  at most one decode reservation and one prefill hold, so this bounds reservations;
- KV blocks (`--max-kv-blocks-per-client`): what its running engine requests' prompts take
  on decode, ceil(prompt tokens / block size) each (what decode reserves for a push, or
  computes itself), charged by the proxy's engine client while each engine request runs
  (`kv_blocks_held`, router/pd_engine_client.py). A long prompt counts for what it pins,
  not as one request like a short one.

Past either bound the request gets 429 with `Retry-After` and an OpenAI error body
(`client_quota_exceeded`) at once, other clients are served as before; a prompt larger
than the whole block budget gets 413, since no retry can pass. A request stops counting
when its response has been sent or its client has gone (the server then aborts it,
releasing its reservations); its blocks, when its engine requests end.

A client is counted by its TCP peer address, by its API key, or both (`--quota-by`; with
both, each bound applies to the address and to the key): behind a load balancer every
client has the balancer's address, and with one API key shared by every client the key
does not tell them apart. Keys are counted by a hash of the bearer token, never the
token itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from splitserve.runtime.access import bearer_token
from splitserve.runtime.drain import RETRY_AFTER_S
from splitserve.protocol.errors import APIError, error_body

# Generation requests: what reserves KV in a P/D deployment.
QUOTA_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
QUOTA_BY = ("address", "api-key")  # what a client is counted by
_WHAT = {"address": "client address", "api-key": "API key"}


@dataclass(frozen=True)
class QuotaLimits:
    max_in_flight: int = 0  # requests per client (0: no bound)
    max_kv_blocks: int = 0  # KV blocks per client (0: no bound)
    by: tuple[str, ...] = ("address",)  # of QUOTA_BY

    def __post_init__(self) -> None:
        if self.max_in_flight < 0 or self.max_kv_blocks < 0:
            raise ValueError("per-client bounds must be >= 0 (0: no bound)")
        if not self.by or set(self.by) - set(QUOTA_BY):
            raise ValueError(f"--quota-by takes {' and/or '.join(QUOTA_BY)}, not {' '.join(self.by)}")

    @property
    def enabled(self) -> bool:
        return self.max_in_flight > 0 or self.max_kv_blocks > 0


class ClientCharge:
    """The clients one request counts for (its address and/or its key), through which
    its engine requests charge KV blocks."""

    def __init__(self, quota: ClientQuota, clients: tuple[str, ...]) -> None:
        self.quota = quota
        self.clients = clients

    def hold(self, blocks: int) -> None:
        """Charge `blocks` to every client of the request, or raise (nothing charged)."""
        limit = self.quota.limits.max_kv_blocks
        if limit <= 0:
            return
        if blocks > limit:
            raise APIError(
                413,
                f"this request's prompt takes {blocks} KV blocks, more than the {limit} a client may hold",
                code="client_quota_exceeded",
            )
        for client in self.clients:
            held = self.quota.kv_blocks(client)
            if held + blocks > limit:
                raise APIError(
                    429,
                    f"this {_what(client)} holds {held} of its {limit} KV blocks and this request's "
                    f"prompt takes {blocks}; retry when a request has finished",
                    code="client_quota_exceeded",
                    retry_after_s=RETRY_AFTER_S,
                )
        for client in self.clients:
            self.quota.add_blocks(client, blocks)

    def release(self, blocks: int) -> None:
        if self.quota.limits.max_kv_blocks > 0:
            for client in self.clients:
                self.quota.add_blocks(client, -blocks)


# The request being served, as ClientQuota set it: a context variable, so each request's
# tasks (its engine streams included) see their own, and code outside a request none.
_CURRENT_CHARGE: contextvars.ContextVar[ClientCharge | None] = contextvars.ContextVar(
    "splitserve_client_charge", default=None
)


@contextlib.contextmanager
def kv_blocks_held(blocks: int) -> Iterator[None]:
    """Charge `blocks` to the clients of the request being served while the body runs:
    APIError 429 `client_quota_exceeded` past a client's budget. Outside a request under
    a block quota, nothing is charged."""
    charge = _CURRENT_CHARGE.get()
    if charge is None or blocks <= 0:
        yield
        return
    charge.hold(blocks)
    try:
        yield
    finally:
        charge.release(blocks)


class ClientQuota:
    """ASGI wrapper enforcing `limits` on QUOTA_PATHS. Runs on one event loop, so plain
    counters suffice."""

    def __init__(self, app: Any, limits: QuotaLimits) -> None:
        self.app = app
        self.limits = limits
        self._in_flight: dict[str, int] = {}
        self._kv_blocks: dict[str, int] = {}

    def in_flight(self, client: str) -> int:
        return self._in_flight.get(client, 0)

    def kv_blocks(self, client: str) -> int:
        return self._kv_blocks.get(client, 0)

    def add_blocks(self, client: str, blocks: int) -> None:
        _add(self._kv_blocks, client, blocks)

    def clients_of(self, scope: dict) -> tuple[str, ...]:
        clients = []
        if "address" in self.limits.by:
            peer = scope.get("client")
            clients.append(f"address:{peer[0] if peer else 'unknown'}")
        if "api-key" in self.limits.by:
            token = bearer_token(scope)
            digest = hashlib.sha256(token.encode()).hexdigest()[:32] if token else "none"
            clients.append(f"api-key:{digest}")
        return tuple(clients)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.limits.enabled or scope.get("path") not in QUOTA_PATHS:
            await self.app(scope, receive, send)
            return
        clients = self.clients_of(scope)
        limit = self.limits.max_in_flight
        if limit > 0:
            for client in clients:
                if self.in_flight(client) >= limit:
                    await _refuse(send, f"this {_what(client)} has {limit} requests in flight, its limit")
                    return
        for client in clients:
            _add(self._in_flight, client, 1)
        token = _CURRENT_CHARGE.set(ClientCharge(self, clients))
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT_CHARGE.reset(token)
            for client in clients:
                _add(self._in_flight, client, -1)


def _what(client: str) -> str:
    return _WHAT[client.partition(":")[0]]


def _add(counts: dict[str, int], client: str, change: int) -> None:
    left = counts.get(client, 0) + change
    if left > 0:
        counts[client] = left
    else:
        counts.pop(client, None)


async def _refuse(send: Any, why: str) -> None:
    message = f"{why}; retry when one has finished"
    payload = json.dumps(error_body(429, message, code="client_quota_exceeded")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
