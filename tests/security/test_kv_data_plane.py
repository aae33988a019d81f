"""The KV data plane carries no paths: a fake peer cannot make a worker open, extend or
write a file of its choosing (the issue's file-overwrite attack, through the transport's
Python API with a real ZeroMQ peer)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.kv.transport_factory import make_transport
from splitserve.kv.transport_types import PeerInfo
from tests.kv.transport_peer import SHAPE, filled_pool

PRECIOUS = b"precious data that KV must never overwrite\n"


class FakePeer:
    """A ZeroMQ ROUTER that answers every HELLO with `reply` and counts what else arrives."""

    def __init__(self, reply: dict):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.reply = reply
        self.kinds: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(20):
                identity, kind, *_ = self.socket.recv_multipart()
                self.kinds.append(kind)
                if kind == b"HELLO":
                    self.socket.send_multipart([identity, json.dumps(self.reply).encode()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close(linger=0)
        self.context.term()


def _push_to(peer: FakePeer, engine_id: str) -> str | None:
    """One layer pushed by a real shm sender to the fake peer; the sender's error."""
    sender = make_transport("prefill-sender", TransferConfig(transport="shm", timeout_s=5))
    try:
        filled_pool(sender)
        sender.start()
        sender.push_layer(PeerInfo(engine_id, "127.0.0.1", peer.port), "t1", 0, [0], [0])
        assert sender.flush(10)
        return sender.take_send_error("t1")
    finally:
        sender.close()


@pytest.mark.parametrize("offer", ["path", "descriptor"])
def test_a_peer_cannot_point_the_sender_at_a_file(tmp_path: Path, offer: str):
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    victim_fd = os.open(victim, os.O_RDWR)  # a file this very process has open
    reply: dict = {"shape": list(SHAPE), "dtype": "float32"}
    if offer == "path":  # the attack: the old HELLO field
        reply["shm_path"] = str(victim)
    else:  # a real descriptor of a real process, but not a KV segment
        reply |= {"shm_pid": os.getpid(), "shm_fd": victim_fd}
    peer = FakePeer(reply)
    try:
        error = _push_to(peer, "decode-evil")
        assert error is not None
        assert "shared-memory pool" in error or "not its KV pool" in error
        assert victim.read_bytes() == PRECIOUS  # not extended, not written
        assert b"PUSH" not in peer.kinds
    finally:
        peer.close()
        os.close(victim_fd)


def test_a_segment_named_like_kv_but_of_another_peer_is_refused(tmp_path: Path):
    """A real, unlinked KV segment of engine A offered as engine B's: the name the worker
    derives from B's identity does not match, so it is not mapped."""
    owner = make_transport("decode-a", TransferConfig(transport="shm"))
    try:
        pool = owner.allocate_pool(SHAPE, torch.float32)
        layout = owner.layout()
        peer = FakePeer(
            {"shape": list(SHAPE), "dtype": "float32", "shm_pid": layout.shm_pid, "shm_fd": layout.shm_fd}
        )
        try:
            assert "not its KV pool" in (_push_to(peer, "decode-b") or "")
            assert not pool.any()
        finally:
            peer.close()
    finally:
        owner.close()
