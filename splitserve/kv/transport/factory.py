"""Building the transport a `TransferConfig` names (kept out of base.py, which the
transports themselves import)."""

from __future__ import annotations

from splitserve.config import TransferConfig
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.types import TransferError


def make_transport(
    engine_id: str, config: TransferConfig, host: str = "127.0.0.1", port: int = 0, max_queued_jobs: int = 64
) -> KVTransport:
    """The transport `config.transport` names."""
    if config.transport == "shm":
        from splitserve.kv.transport.shm import ShmTransport

        return ShmTransport(engine_id, config, host, port, max_queued_jobs)
    if config.transport == "tcp":
        from splitserve.kv.transport.tcp import TcpTransport

        return TcpTransport(engine_id, config, host, port, max_queued_jobs)
    if config.transport == "nixl":
        from splitserve.kv.transport.nixl import NixlTransport

        return NixlTransport(engine_id, config, host, port, max_queued_jobs)
    if config.transport == "auto":
        from splitserve.kv.transport.auto import AutoTransport

        return AutoTransport(engine_id, config, host, port, max_queued_jobs)
    raise TransferError(f"unknown KV transport {config.transport!r} (shm, tcp, nixl or auto)")
