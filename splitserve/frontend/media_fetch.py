"""Fetching a remote image for the render tier: only from the operator's allowed domains,
never from a private address, within a size and a time limit.

The host is resolved once; every address must be public (loopback, private, link-local
and the like are refused unless the operator allows them for image servers inside the
deployment), and the connection goes to the address that was checked (the Host header
and TLS server name stay the domain's), so a DNS answer that changes between the check
and the fetch cannot redirect it. Redirects are not followed.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from splitserve.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class FetchPolicy:
    allowed_domains: tuple[str, ...]  # exact host names (lowercase)
    max_bytes: int
    timeout_s: float = 10.0  # the whole fetch, not each read
    allow_private_addresses: bool = False


def _public_address(host: str, port: int, policy: FetchPolicy) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidRequestError(f"cannot resolve image host {host!r}", param="messages") from exc
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not policy.allow_private_addresses and any(not a.is_global for a in addresses):
        raise InvalidRequestError(f"image host {host!r} resolves to a private address", param="messages")
    # IPv4 first: a dual-stack name whose server listens on IPv4 only still works
    return str(sorted(addresses, key=lambda a: a.version)[0])


def fetch_image(url: str, policy: FetchPolicy) -> bytes:
    """The body of an http(s) image URL; InvalidRequestError (400, or 413 past max_bytes)."""
    parsed = urlparse(url)
    host = (parsed.hostname or "").lower()
    if parsed.scheme not in ("http", "https") or not host:
        raise InvalidRequestError(f"unsupported image URL {url[:80]!r}", param="messages")
    if host not in policy.allowed_domains:
        raise InvalidRequestError(f"image host {host!r} is not an allowed media domain", param="messages")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    address = _public_address(host, port, policy)
    netloc = f"[{address}]" if ":" in address else address
    pinned = parsed._replace(netloc=f"{netloc}:{port}").geturl()
    headers = {"Host": parsed.netloc.rsplit("@", 1)[-1]}
    try:
        with (
            httpx.Client(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as client,
            client.stream("GET", pinned, headers=headers, extensions={"sni_hostname": host}) as response,
        ):
            if response.status_code != 200:
                raise InvalidRequestError(
                    f"fetching the image returned HTTP {response.status_code}", param="messages"
                )
            body = bytearray()
            deadline = time.monotonic() + policy.timeout_s
            for chunk in response.iter_bytes():
                body += chunk
                if time.monotonic() > deadline:  # a server dripping bytes
                    raise InvalidRequestError(
                        f"fetching the image took over {policy.timeout_s:g} s", param="messages"
                    )
                if len(body) > policy.max_bytes:
                    raise InvalidRequestError(
                        f"remote image is over max_encoded_bytes ({policy.max_bytes})",
                        param="messages",
                        status=413,
                    )
            return bytes(body)
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"cannot fetch the image: {type(exc).__name__}", param="messages") from exc
