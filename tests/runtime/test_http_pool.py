"""Internal HTTP clients see a peer that dies as it accepts as unreachable, never as an
internal error (seen as a proxy 500 when a Ray decode replica was killed)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvloop

from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.runtime.http_engine_client import HTTPEngineClient
from splitserve.runtime.http_pool import pooled_client

ATTEMPTS = 300  # the race hit about one connection in eight here


@pytest.fixture
def resetting_server() -> Iterator[int]:
    """A port whose listener accepts every connection and resets it at once (SO_LINGER 0)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)

    def accept_and_reset() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    thread = threading.Thread(target=accept_and_reset, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=10)


def test_an_engine_that_resets_connections_is_unreachable_every_time(resetting_server: int) -> None:
    async def attempts() -> list[APIError]:
        client = HTTPEngineClient(f"http://127.0.0.1:{resetting_server}", name="decode worker")
        errors = []
        try:
            for _ in range(ATTEMPTS):
                with pytest.raises(APIError) as caught:
                    async for _chunk in client.generate(GenerateRequest("reset", (1, 2))):
                        pass
                errors.append(caught.value)
        finally:
            await client.close()
        return errors

    errors = uvloop.run(attempts())
    assert len(errors) == ATTEMPTS
    assert {error.status for error in errors} == {503}
    assert all("decode worker" in str(error) and "unreachable" in str(error) for error in errors)


def test_a_pooled_client_fails_resets_as_transport_errors_and_still_serves(resetting_server: int) -> None:
    async def serve_once() -> int:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        live_port = server.sockets[0].getsockname()[1]
        client = pooled_client(read_timeout_s=10.0)
        try:
            for _ in range(ATTEMPTS):
                with pytest.raises(httpx.TransportError):
                    await client.get(f"http://127.0.0.1:{resetting_server}/health")
            return (await client.get(f"http://127.0.0.1:{live_port}/health")).status_code
        finally:
            await client.aclose()
            server.close()

    assert uvloop.run(serve_once()) == 200
