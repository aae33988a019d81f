"""Replay and session attacks on the KV data plane: a captured message replayed is dropped,
a HELLO flood evicts only the flooding peer's own sessions, and the replay guard bounds
sessions per peer and in all (through the transport's Python API, real ZeroMQ peers)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.kv.transport.frame_mac import MAX_SESSIONS_PER_PEER, FrameMac, ReplayGuard, hello_stamp, stamp
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.types import PeerInfo
from tests.conftest import wait_until
from tests.kv.transport_peer import SHAPE, filled_pool, pattern


class Tap:
    """A man in the middle on the KV link: forwards a sender's messages to the real
    receiver (and the replies back) and keeps a copy of each, as a network capture would."""

    def __init__(self, target: PeerInfo):
        self.context = zmq.Context()
        self.front = self.context.socket(zmq.ROUTER)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = self.context.socket(zmq.DEALER)
        self.back.connect(f"tcp://{target.host}:{target.port}")
        self.captured: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        identity = b""
        while not self._stop.is_set():
            ready = dict(poller.poll(20))
            if self.front in ready:
                identity, *message = self.front.recv_multipart()
                self.captured.append(message)
                self.back.send_multipart(message)
            if self.back in ready:
                self.front.send_multipart([identity, *self.back.recv_multipart()])

    def replay(self, message: list[bytes]) -> None:
        """Send a captured message again: on the tap's own connection, then on a new one."""
        self.back.send_multipart(message)
        fresh = self.context.socket(zmq.DEALER)
        fresh.connect(self.back.getsockopt_string(zmq.LAST_ENDPOINT))
        fresh.send_multipart(message)
        time.sleep(0.3)  # let both reach the receiver before the socket goes
        fresh.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.front.close(linger=0)
        self.back.close(linger=0)
        self.context.term()


def test_a_captured_kv_message_replayed_is_dropped(monkeypatch):
    """Someone who captured the deployment's own, validly tagged PUSH messages sends them
    again (and an older one after a newer): decode drops them, nothing is written, and
    the real transfer still completes."""
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")
    config = TransferConfig(transport="tcp", timeout_s=5.0)
    decode = make_transport("decode-0", config)
    pool = decode.allocate_pool(SHAPE, torch.float32)
    tap = Tap(decode.start())
    prefill = make_transport("prefill-0", config)
    outcomes = []
    done = threading.Event()

    def on_done(result) -> None:
        outcomes.append(result)
        done.set()

    try:
        filled_pool(prefill)
        prefill.start()
        decode.expect("t", [2], on_done)
        via_tap = PeerInfo("decode-0", "127.0.0.1", tap.port)
        prefill.push_layer(via_tap, "t", 0, [2], [2])
        prefill.push_layer(via_tap, "t", 1, [2], [2])
        assert prefill.flush(10)
        assert wait_until(lambda: bool(pool[1, :, 2].any()))
        pushes = [message for message in tap.captured if message[0] == b"PUSH"]
        assert len(pushes) == 2
        pool[:, :, 2] = 0  # what a replayed layer 0 or 1 would write again
        refused_before = decode.control.sessions.refused
        for message in (pushes[0], pushes[1]):  # a replay, and an older one after a newer
            tap.replay(message)
        assert wait_until(lambda: decode.control.sessions.refused >= refused_before + 4)
        assert not pool.any()
        assert not done.is_set()
        for layer in range(SHAPE[0]):  # the live session goes on: the transfer completes
            prefill.push_layer(via_tap, "t", layer, [2], [2])
        assert prefill.flush(10) and done.wait(10)
        assert outcomes[0].ok, outcomes[0]
        assert torch.equal(pool[:, :, [2]], pattern([2]))
    finally:
        prefill.close()
        tap.close()
        decode.close()


class TokenHolder:
    """A raw DEALER connection holding the deployment's token: it speaks the KV protocol
    (MAC, stamps) by hand, as a compromised or buggy engine could."""

    def __init__(self, target: PeerInfo, token: str):
        self.mac = FrameMac(token)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(f"tcp://{target.host}:{target.port}")

    def hello_flood(self, count: int, claimed_engine_id: str) -> list[bytes]:
        """`count` HELLOs on this one connection; the sessions the receiver issued, in order."""
        header = json.dumps({"engine_id": claimed_engine_id}).encode()
        for _ in range(count):
            self.socket.send_multipart(self.mac.seal([b"HELLO", header, hello_stamp()]))
        sessions = []
        for _ in range(count):
            assert self.socket.poll(10_000), "the receiver stopped answering HELLOs"
            reply = self.mac.open(self.socket.recv_multipart())
            assert reply is not None
            sessions.append(bytes.fromhex(json.loads(reply[0])["session"]))
        return sessions

    def send_stamped(self, session: bytes, sequence: int) -> None:
        """A harmless message (RELEASE of an unknown transfer) under `session`."""
        frames = [b"RELEASE", json.dumps({"transfer_id": "none"}).encode(), stamp(session, sequence)]
        self.socket.send_multipart(self.mac.seal(frames))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def test_a_hello_flood_evicts_only_the_flooding_peers_sessions(monkeypatch):
    """A token holder sends more HELLOs on one connection than the receiver used to keep
    sessions in all (claiming the victim's engine ID, too): only its own oldest sessions are
    forgotten; the victim's lane, in the middle of a transfer, goes on and completes it."""
    token = "the-deployment-token"
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", token)
    config = TransferConfig(transport="tcp", timeout_s=5.0)
    decode = make_transport("decode-0", config)
    pool = decode.allocate_pool(SHAPE, torch.float32)
    peer = decode.start()
    victim = make_transport("prefill-0", config)
    flooder = TokenHolder(peer, token)
    outcomes = []
    done = threading.Event()

    def on_done(result) -> None:
        outcomes.append(result)
        done.set()

    try:
        filled_pool(victim)
        victim.start()
        decode.expect("t", [2], on_done)
        victim.push_layer(peer, "t", 0, [2], [2])  # the victim's lane says HELLO: its session
        assert victim.flush(10)
        assert wait_until(lambda: bool(pool[0, :, 2].any()))

        sessions = flooder.hello_flood(4200, claimed_engine_id="prefill-0")  # the old bound: 4,096 in all
        guard = decode.control.sessions
        assert guard.num_sessions() == MAX_SESSIONS_PER_PEER + 1  # the flooder's newest, and the victim's
        refused = guard.refused
        flooder.send_stamped(sessions[0], 1)  # its oldest: forgotten
        assert wait_until(lambda: guard.refused == refused + 1)
        flooder.send_stamped(sessions[-1], 1)  # its newest: still valid
        flooder.send_stamped(sessions[0], 2)  # a message after the newest's: still refused
        assert wait_until(lambda: guard.refused == refused + 2)

        for layer in range(1, SHAPE[0]):  # the victim's next stamped messages are admitted
            victim.push_layer(peer, "t", layer, [2], [2])
        assert victim.flush(10) and done.wait(10)
        assert outcomes[0].ok, outcomes[0]
        assert torch.equal(pool[:, :, [2]], pattern([2]))
        assert guard.refused == refused + 2
    finally:
        flooder.close()
        victim.close()
        decode.close()


def test_the_replay_guard_bounds_sessions_per_peer_and_peers_in_all():
    """ReplayGuard's accounting: each peer keeps its newest sessions; past the peer bound
    the least recently active peer is forgotten, not the one in use."""
    guard = ReplayGuard(max_sessions_per_peer=2, max_peers=2)
    b = guard.issue(b"peer-b")
    assert guard.admit(stamp(b, 1))
    a = [guard.issue(b"peer-a") for _ in range(10)]
    assert guard.num_sessions(b"peer-a") == 2 and guard.num_sessions(b"peer-b") == 1
    assert not guard.admit(stamp(a[0], 1)) and not guard.admit(stamp(a[7], 1))
    assert guard.admit(stamp(a[8], 1)) and guard.admit(stamp(a[9], 1))
    assert guard.admit(stamp(b, 2))  # B used its session last: A is the least recently active
    guard.issue(b"peer-c")
    assert guard.num_sessions(b"peer-a") == 0
    assert not guard.admit(stamp(a[9], 2))
    assert guard.admit(stamp(b, 3))
    assert not guard.admit(stamp(b, 3))  # a replay is still a replay
    with pytest.raises(ValueError):
        ReplayGuard(max_sessions_per_peer=0)
