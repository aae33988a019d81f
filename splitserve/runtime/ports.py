"""Choosing a TCP port for a part that binds it later, in another process.

A port found with `bind(("", 0))` comes from the kernel's ephemeral range, and so does the
source port of every outgoing connection. Between the pick and the part's own bind (the
seconds a Python process takes to start) any connection on the host may take it; then the
part fails with "address already in use", or a stranger's connection reaches it. Ports
below the ephemeral range are never handed out by the kernel, so a pick there stays free
unless someone names it explicitly.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICK = 10_000  # above the well-known and most registered service ports
_ATTEMPTS = 200


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (Linux; IANA's range elsewhere)."""
    try:
        low, high = (int(field) for field in _EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port that is free on `host` now and that the kernel will not hand to anyone else.

    `avoid` holds ports already picked for parts that have not bound them yet.
    """
    low, _high = ephemeral_port_range()
    if low - _LOWEST_PICK >= 1000:
        rng = random.SystemRandom()
        for _ in range(_ATTEMPTS):
            port = rng.randrange(_LOWEST_PICK, low)
            if port not in avoid and port_is_free(host, port):
                return port
    # No room below the ephemeral range (or all of it taken): let the kernel choose.
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
