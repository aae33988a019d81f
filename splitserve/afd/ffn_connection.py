"""One connection of an attention engine to its FFN daemon: the ZeroMQ DEALER socket and
its disconnect monitor, the HELLO that opens it, the session that stamps its requests,
and (shm) the shared-memory segment offered in that HELLO (afd/shm_slots.py). A new
HELLO makes all of them again; ffn_client.py keeps the layers in flight across them.

With the internal token every message is sealed (frame_mac.py, under the AFD label), the
HELLO's reply must carry its fresh challenge, and a later reply the stamp of the request
it answers; a reply that fails the MAC, or an untagged "unauthorized", is AfdError.
"""

from __future__ import annotations

import itertools
import json
import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.afd.shm_slots import SLOTS, EngineSegment, SlotLayout
from splitserve.afd.wire import DTYPES, afd_mac
from splitserve.kv.transport.frame_mac import SenderSession, hello_stamp
from splitserve.kv.transport.types import TransferError
from splitserve.protocol.afd import AFD_TRANSPORTS, HELLO, UNAUTHORIZED, FfnLayout

logger = logging.getLogger(__name__)


class AfdError(RuntimeError):
    """The FFN daemon cannot be reached, refused us, or does not hold this model."""


class DaemonLost(AfdError):
    """The daemon's connection closed (it died, or `up` is starting it again)."""


class DaemonSilent(AfdError):
    """No answer by the layer's deadline: the daemon is stopped or wedged (or very slow)."""


class FfnConnection:
    """Not thread-safe: FfnClient holds its lock around every call."""

    def __init__(
        self,
        address: str,
        token: str | None,
        transport: str,
        slot_tokens: int,
        node_id: str | None,
    ) -> None:
        if transport not in AFD_TRANSPORTS:
            raise ValueError(f"the AFD transport must be one of {AFD_TRANSPORTS}, not {transport!r}")
        self.address = address
        self.transport = transport
        self.slot_tokens = slot_tokens
        self.node_id = node_id
        self.mac = afd_mac(token)
        self.context = zmq.Context()
        self.session = SenderSession()
        self.hellos = itertools.count()
        self.socket: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # the socket's disconnect events
        self.segment: EngineSegment | None = None  # this connection's, when the daemon mapped it

    @property
    def open(self) -> bool:
        return self.socket is not None

    def hello(self, timeout_s: float, expected: FfnLayout | None) -> FfnLayout:
        """A new connection: the daemon's layout (AfdError when it does not answer in time,
        refuses, or holds other than `expected`; under shm, when it cannot map the segment)."""
        self.close()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # the daemon's death shows as its connection closing: the layers in flight are sent
        # again to the daemon `up` starts in its place, not waited for until the timeout
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(self.address)
        segment = self.new_segment(expected)
        try:
            answer = self.hello_answer(timeout_s, segment)
            if self.mac.enabled:
                self.session.start(bytes.fromhex(str(answer["session"])))
            layout = FfnLayout.from_header(answer)
            if expected is not None and layout != expected:
                raise AfdError(
                    f"the FFN daemon at {self.address} holds {layout}, this engine needs {expected}"
                )
            if segment is not None:
                self.take_segment(segment, answer)
        except (KeyError, ValueError) as exc:
            if segment is not None:
                segment.close()
            raise AfdError(f"the FFN daemon at {self.address} answered HELLO with {exc!r}") from exc
        except AfdError:
            if segment is not None:
                segment.close()
            raise
        return layout

    def new_segment(self, layout: FfnLayout | None) -> EngineSegment | None:
        """A fresh segment to offer in a HELLO (none over tcp, or where it cannot be made)."""
        if self.transport == "tcp" or layout is None:
            return None
        try:
            return EngineSegment(
                SlotLayout(layout.hidden_size, layout.top_k, DTYPES[layout.dtype], SLOTS, self.slot_tokens)
            )
        except (OSError, TransferError) as exc:
            if self.transport == "shm":
                raise AfdError(f"no shared-memory segment for the FFN daemon: {exc}") from exc
            logger.info("no shared-memory segment for the FFN daemon (%s): tensors go over tcp", exc)
            return None

    def take_segment(self, segment: EngineSegment, answer: dict) -> None:
        """Use the segment if the daemon mapped it; under shm, refuse a daemon that did not."""
        if answer.get("shm") is True:
            self.segment = segment
            return
        segment.close()
        reason = answer.get("shm_error") or "it does not map shared memory"
        if self.transport == "shm":
            raise AfdError(
                f"the FFN daemon at {self.address} cannot use this engine's shared memory ({reason}); "
                "--afd-transport tcp or auto sends the tensors over the socket"
            )
        logger.info(
            "the FFN daemon at %s cannot use shared memory (%s): tensors go over tcp", self.address, reason
        )

    def hello_answer(self, timeout_s: float, segment: EngineSegment | None) -> dict:
        stamp = hello_stamp() if self.mac.enabled else b""
        header: dict = {"id": f"hello-{next(self.hellos)}"}  # never a layer's (an int)
        if segment is not None:
            header["shm"] = segment.offer(self.node_id).to_header()
        self.send([HELLO, json.dumps(header).encode()], stamp)
        deadline = time.monotonic() + timeout_s
        while True:
            frames = self.next_reply(deadline)
            if frames is None:
                self.close()  # what may still arrive belongs to a HELLO given up on
                raise AfdError(f"the FFN daemon at {self.address} did not answer HELLO in {timeout_s:.1f} s")
            reply_stamp, answer, _ = self.open_reply(frames)
            if reply_stamp == stamp and answer.get("id") == header["id"]:
                return answer

    def close(self) -> None:
        """The connection and its segment: a new HELLO makes both again."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.socket is None:
            return
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close()
            self.monitor = None
        self.socket.close()
        self.socket = None

    def terminate(self) -> None:
        self.close()
        self.context.term()

    def send(self, frames: list[bytes], stamp: bytes) -> None:
        """Sends the sealed message."""
        assert self.socket is not None
        self.socket.send_multipart(self.mac.seal([*frames, stamp] if self.mac.enabled else frames))

    def next_stamp(self) -> bytes:
        return self.session.next_stamp() if self.mac.enabled else b""

    def next_reply(self, deadline: float) -> list[bytes] | None:
        """The next message from the daemon, or None at the deadline; DaemonLost when its
        connection closes."""
        assert self.socket is not None and self.monitor is not None
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while (left_s := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left_s * 1000))
            if self.socket in ready:
                return self.socket.recv_multipart()
            if (
                self.monitor in ready
                and recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
            ):
                self.close()
                raise DaemonLost(f"the FFN daemon at {self.address} closed the connection")
        return None

    def open_reply(self, reply: list[bytes]) -> tuple[bytes, dict, list[bytes]]:
        """A reply's stamp (that of the request it answers; b"" without a token), header
        and data frames; AfdError for a refusal or a reply not sealed with our key."""
        body = self.mac.open(reply)
        if body is None:
            raise AfdError(self.refusal(reply))
        stamp = b""
        if self.mac.enabled:
            if len(body) < 2:
                raise AfdError(f"a reply from {self.address} without its request's stamp")
            stamp, body = body[-1], body[:-1]
        try:
            answer = json.loads(body[0])
        except ValueError as exc:
            raise AfdError(f"a reply from {self.address} with an unreadable header: {exc}") from exc
        if not isinstance(answer, dict):
            raise AfdError(f"a reply from {self.address} whose header is not a JSON object")
        if answer.get("error") == UNAUTHORIZED:  # we have no token, the daemon has one
            raise AfdError(self.refusal(reply))
        if not answer.get("ok"):
            raise AfdError(f"the FFN daemon at {self.address} refused a request: {answer.get('error')}")
        return stamp, answer, body[1:]

    def refusal(self, reply: list[bytes]) -> str:
        try:
            unauthorized = json.loads(reply[0]).get("error") == UNAUTHORIZED
        except (ValueError, AttributeError, IndexError):
            unauthorized = False
        if unauthorized:
            return (
                f"the FFN daemon at {self.address} refused this engine: not this deployment's internal token"
            )
        return f"a reply from {self.address} failed authentication (not this deployment's FFN daemon)"
