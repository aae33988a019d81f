"""The KV control plane's message framing, the same at both ends of every transport.

A message is `[kind, JSON header, data frames...]` sealed with the deployment's per-frame
MAC (frame_mac.py). With a key, each request carries a stamp (the session its receiver
issued at HELLO, and a sequence number) inside the MAC, and each reply carries the stamp
of the request it answers: a receiver admits a stamp once (ReplayGuard), so a captured
message sent again is dropped, and a sender takes only the reply to its own request.
"""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

import zmq

from splitserve.kv.transport.frame_mac import FrameMac, ReplayGuard, hello_stamp
from splitserve.kv.transport.send_lane import LaneSocket
from splitserve.kv.transport.types import TransferError

logger = logging.getLogger(__name__)


class InboundMessage(NamedTuple):
    identity: zmq.Frame  # the sending DEALER, as the ROUTER socket names it
    kind: bytes  # HELLO, PUSH, HELD, PULL, RELEASE, FAIL
    header: dict
    data: list[zmq.Frame]  # the frames after the header (a pushed layer's blocks)
    stamp: bytes  # b"" without a key


class ControlChannel:
    def __init__(self, secret: str | None) -> None:
        self.mac = FrameMac(secret)  # every message tagged with the deployment's key
        self.sessions = ReplayGuard()  # the sessions this receiver issued (replays are dropped)

    # ---- sender side -----------------------------------------------------------------------
    def send(self, socket: LaneSocket, kind: bytes, header: dict, data: object | None = None) -> None:
        frames: list = [kind, json.dumps(header).encode()]
        if data is not None:
            frames.append(data)
        if self.mac.enabled:  # the stamp, inside the MAC: a replayed message is refused
            socket.last_stamp = hello_stamp() if kind == b"HELLO" else socket.session.next_stamp()
            frames.append(socket.last_stamp)
        socket.send_multipart(self.mac.seal(frames), copy=data is None)

    def receive_reply(self, socket: LaneSocket) -> dict:
        """The answer to the last request sent on `socket` (zmq.Again past its timeout)."""
        frames = self.mac.open(socket.recv_multipart())
        if frames is None:
            raise TransferError("a KV peer's reply failed authentication (not this deployment's)")
        if self.mac.enabled and (len(frames) != 2 or frames[1] != socket.last_stamp):
            raise TransferError("a KV peer's reply does not answer our request (replayed?)")
        return json.loads(frames[0])

    def start_session(self, socket: LaneSocket, hello_reply: dict, peer_name: str) -> None:
        """After HELLO: the session the peer issued stamps our next requests to it."""
        if not self.mac.enabled:
            return
        try:
            socket.session.start(bytes.fromhex(str(hello_reply["session"])))
        except (KeyError, ValueError) as exc:
            raise TransferError(f"KV peer {peer_name} answered HELLO without a session") from exc

    # ---- receiver side ---------------------------------------------------------------------
    def open(self, frames: list[zmq.Frame]) -> InboundMessage | None:
        """A received message, or None (logged) when it fails authentication, has no
        stamp, or is a replay or of a session this receiver never issued."""
        body = self.mac.open(frames[1:])
        if body is None:
            logger.warning("dropped a KV message that failed authentication")
            return None
        stamp = b""
        if self.mac.enabled:
            if len(body) < 3:
                logger.warning("dropped a KV message without a stamp")
                return None
            stamp, body = body[-1].bytes, body[:-1]
            if body[0].bytes != b"HELLO" and not self.sessions.admit(stamp):
                logger.warning("dropped a replayed KV message (or of a session we did not issue)")
                return None
        return InboundMessage(frames[0], body[0].bytes, json.loads(body[1].bytes), list(body[2:]), stamp)

    def hello_answer(self, message: InboundMessage, layout: dict) -> dict:
        """HELLO's answer: the pool layout, and with a key a session issued for the asker,
        accounted to the connection it asked on (ReplayGuard)."""
        if self.mac.enabled:
            return {**layout, "session": self.sessions.issue(message.identity.bytes).hex()}
        return layout

    def reply(self, router: zmq.Socket, message: InboundMessage, answer: dict) -> None:
        """Answer `message`; the MAC covers its stamp, binding the reply to it."""
        frames: list = [json.dumps(answer).encode()]
        if self.mac.enabled:
            frames.append(message.stamp)
        router.send_multipart([message.identity, *self.mac.seal(frames)])
