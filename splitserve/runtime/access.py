"""Who may call a process: the public API key, the deployment's internal token, and the
paths that answer without either. See docs/security.md.

Two credentials, one header (`Authorization: Bearer ...`, OpenAI's convention):
- the API keys (`--api-key`, repeated for several, or SPLITSERVE_API_KEY with several
  separated by commas: a bearer token never holds one) guard the public OpenAI API of
  `serve` and the proxy;
- the internal token (SPLITSERVE_INTERNAL_TOKEN, or `--internal-token-file`) guards every
  internal part (engines, render tier): only the deployment's own proxy and parts have it.
  `up` generates one per deployment and hands it to each part through the environment,
  never on a command line (where `ps` shows it to every user of the host).

The guard is a plain ASGI wrapper, so streaming responses pass through untouched, and it
also hides FastAPI's /docs, /redoc and /openapi.json unless asked (`--enable-docs`).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
from typing import NamedTuple

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.protocol.errors import error_body

API_KEY_ENV = "SPLITSERVE_API_KEY"
INTERNAL_TOKEN_ENV = "SPLITSERVE_INTERNAL_TOKEN"
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_WITH_FLAG = frozenset({"/health", "/metrics"})


class AccessPolicy(NamedTuple):
    """`keys`: the bearer tokens accepted (none: the process is open); `open_paths`
    answer without one; `docs` keeps FastAPI's generated documentation reachable."""

    keys: tuple[str, ...]
    open_paths: frozenset[str] = frozenset()
    docs: bool = False


def internal_token() -> str | None:
    """This process's internal token (the CLI puts a `--internal-token-file` into the
    environment at start-up, so every HTTP client of the process finds it here)."""
    return os.environ.get(INTERNAL_TOKEN_ENV) or None


def internal_headers() -> dict[str, str]:
    """The header every internal HTTP client sends (`runtime/http_pool.pooled_client`)."""
    token = internal_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_public_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve` and the proxy: the OpenAI API's key and what answers without it."""
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require `Authorization: Bearer KEY` on the OpenAI API; repeat for several keys "
        f"(default: ${API_KEY_ENV}, several separated by commas)",
    )
    parser.add_argument(
        "--open-health-metrics",
        action="store_true",
        help="/health and /metrics answer without the API key (for probes and scrapers)",
    )


def add_internal_arguments(parser: argparse.ArgumentParser) -> None:
    """Every process (engines, `serve`, render tier, proxy): where the deployment's
    internal token comes from, and whether FastAPI's documentation is served."""
    parser.add_argument(
        "--internal-token-file",
        default=None,
        help=f"file holding the deployment's internal token (default: ${INTERNAL_TOKEN_ENV})",
    )
    parser.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")


def load_internal_token(args: argparse.Namespace) -> str | None:
    """Read `--internal-token-file` into the environment (see `internal_token`); the token
    of this process, or None."""
    path = getattr(args, "internal_token_file", None)
    if path:
        with open(path, encoding="utf-8") as token_file:
            token = token_file.read().strip()
        if not token:
            raise ValueError(f"--internal-token-file {path} is empty")
        os.environ[INTERNAL_TOKEN_ENV] = token
    return internal_token()


def api_keys(value: str | None) -> tuple[str, ...]:
    """The keys in `value` (SPLITSERVE_API_KEY's form): several separated by commas, which
    no bearer token holds (RFC 6750)."""
    return tuple(key.strip() for key in (value or "").split(",") if key.strip())


def public_policy(args: argparse.Namespace) -> AccessPolicy:
    keys = api_keys(",".join(args.api_key)) if args.api_key else api_keys(os.environ.get(API_KEY_ENV))
    open_paths = OPEN_WITH_FLAG if args.open_health_metrics else frozenset()
    return AccessPolicy(keys, open_paths, args.enable_docs)


def internal_policy(args: argparse.Namespace) -> AccessPolicy:
    """An internal part's policy; refuses (ValueError) to listen beyond loopback without a
    token, since anyone who reaches an open engine can write into its KV cache."""
    token = load_internal_token(args)
    if token is None and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} exposes an internal API: set {INTERNAL_TOKEN_ENV} or --internal-token-file"
        )
    return AccessPolicy((token,) if token else (), frozenset(), getattr(args, "enable_docs", False))


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's `Authorization: Bearer` header, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _send_error(send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body})


class AccessGuard:
    """ASGI wrapper enforcing an `AccessPolicy` before the app sees the request."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if not self.policy.docs and path in DOC_PATHS:
            await _send_error(send, 404, "Not Found", [])
            return
        if self.policy.keys and path not in self.policy.open_paths:
            token = bearer_token(scope)
            # Compared in constant time, against every key, so timing tells nothing.
            matches = [hmac.compare_digest(token.encode(), key.encode()) for key in self.policy.keys if token]
            if not any(matches):
                message = "missing or invalid credential: send `Authorization: Bearer <key>`"
                await _send_error(send, 401, message, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)
