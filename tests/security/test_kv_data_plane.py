"""The KV data plane carries no paths: a fake peer cannot make a worker open, extend or
write a file of its choosing (the issue's file-overwrite attack, through the transport's
Python API with a real ZeroMQ peer)."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.types import PeerInfo
from tests.conftest import wait_until
from tests.kv.transport_peer import SHAPE, filled_pool, kv_hashes, pattern, pull_source

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


def test_kv_frames_without_the_deployments_mac_are_dropped(monkeypatch):
    """The issue's raw-ZeroMQ attack on a tcp KV socket: frames written straight to decode's
    socket change nothing; the deployment's own sender (same token) still lands its KV, and
    a sender with another token is not even answered."""
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")
    config = TransferConfig(transport="tcp", timeout_s=1.0)
    decode = make_transport("decode-0", config)
    pool = decode.allocate_pool(SHAPE, torch.float32)
    peer = decode.start()
    context = zmq.Context()
    attacker = context.socket(zmq.DEALER)
    try:
        attacker.connect(f"tcp://{peer.host}:{peer.port}")
        block = torch.full((2, 1, *SHAPE[3:]), 7.0).numpy().tobytes()
        header = {"transfer_id": "victim", "layer": 0, "dst": [0], "ready_at": time.time()}
        attacker.send_multipart([b"PUSH", json.dumps(header).encode(), block])
        attacker.send_multipart([b"PUSH", json.dumps(header).encode(), block, b"\0" * 32])  # a forged tag
        attacker.send_multipart([b"HELLO", b"{}"])
        assert attacker.poll(500) == 0  # no answer to an unauthenticated HELLO
        assert not pool.any()

        monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "another-deployment")
        stranger = make_transport("prefill-x", config)
        try:
            filled_pool(stranger)
            stranger.start()
            stranger.push_layer(peer, "t-stranger", 0, [1], [1])
            assert stranger.flush(10)
            # unanswered: the HELLO's own timeout or the lane's stall bound ends it, whichever
            # comes first (both are the transfer's timeout)
            error = stranger.take_send_error("t-stranger") or ""
            assert "did not answer" in error or "no progress on connection set-up" in error, error
        finally:
            stranger.close()
        assert not pool.any()

        monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")
        prefill = make_transport("prefill-0", config)
        try:
            filled_pool(prefill)
            prefill.start()
            decode.expect("t-legit", [1], lambda result: None)
            prefill.push_layer(peer, "t-legit", 0, [1], [1])
            assert prefill.flush(10)
            assert wait_until(lambda: bool(pool[0, :, 1].any()))
            assert not pool[0, :, 0].any()
        finally:
            prefill.close()
    finally:
        attacker.close(linger=0)
        context.term()
        decode.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_pull_reads_only_the_blocks_its_hold_lent(kind, monkeypatch):
    """The issue's cross-tenant read: a pull names a real hold but another request's block
    IDs, or the hold's blocks under other token hashes (another prompt, or the same prompt
    under another tenant's cache_salt); the source lends only the hold's own blocks and only
    to a reader of the same tokens, so nothing is read. A hold is lent once."""
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")  # the source inherits it
    context = multiprocessing.get_context("spawn")
    to_parent, from_parent = context.Queue(), context.Queue()
    source_process = context.Process(target=pull_source, args=(kind, to_parent, from_parent))
    source_process.start()  # holds blocks 0, 3 and 6 under every transfer ID
    puller = make_transport("decode-puller", TransferConfig(transport=kind, timeout_s=5))
    try:
        puller.allocate_pool(SHAPE, torch.float32)
        puller.start()
        source = PeerInfo(*to_parent.get(timeout=60))
        outcomes: dict[str, object] = {}
        finished = threading.Event()

        def on_done(result) -> None:
            outcomes[result.transfer_id] = result
            if len(outcomes) == 3:
                finished.set()

        puller.expect("victim", [1, 2], on_done)
        # blocks 1, 2: not lent under this hold
        puller.pull(source, "victim", [1, 2], [1, 2], kv_hashes([1, 2]))
        puller.expect("other-salt", [5], on_done)
        puller.pull(source, "other-salt", [6], [5], ["kv-of-other-tokens"])  # a lent block, other hashes
        puller.expect("mine", [4], on_done)
        puller.pull(source, "mine", [3], [4], kv_hashes([3]))
        assert finished.wait(30)
        for refused in ("victim", "other-salt"):
            assert not outcomes[refused].ok and "no longer holds" in outcomes[refused].error
        assert not puller.pool[:, :, [1, 2, 5]].any()
        assert outcomes["mine"].ok, outcomes["mine"]
        assert torch.equal(puller.pool[:, :, [4]], pattern([3]))

        released: list[str] = []  # the source releases the hold once the reader is done
        deadline = time.monotonic() + 10
        while "mine" not in released and time.monotonic() < deadline:
            from_parent.put("report")
            released = to_parent.get(timeout=30)
        again = threading.Event()
        puller.expect("mine", [7], lambda result: (outcomes.__setitem__("again", result), again.set()))
        puller.pull(source, "mine", [3], [7], kv_hashes([3]))  # the same grant, a second time
        assert again.wait(30)
        assert not outcomes["again"].ok and "no longer holds" in outcomes["again"].error
        assert not puller.pool[:, :, [7]].any()
    finally:
        from_parent.put(None)
        source_process.join(30)
        puller.close()


def test_a_token_holder_writes_only_the_blocks_reserved_for_its_transfer(monkeypatch):
    """The issue's 'writing into other requests' blocks' with a sender that holds the
    deployment's token: a push for a transfer decode never reserved, for blocks outside
    the reservation, or of KV computed for other tokens (other block hashes) writes nothing
    and does not count towards completion; the reserved block still lands and completes
    the transfer, and the grant is then spent: the same push again writes nothing."""
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")
    config = TransferConfig(transport="tcp", timeout_s=5.0)
    decode = make_transport("decode-0", config)
    pool = decode.allocate_pool(SHAPE, torch.float32)
    peer = decode.start()
    prefill = make_transport("prefill-0", config)
    outcomes = []
    done = threading.Event()

    def on_done(result) -> None:
        outcomes.append(result)
        done.set()

    try:
        filled_pool(prefill)
        prefill.start()
        decode.expect("granted", [2], on_done, block_hashes=kv_hashes([2]))
        for layer in range(SHAPE[0]):
            prefill.push_layer(peer, "never-reserved", layer, [0], [0])
            prefill.push_layer(peer, "granted", layer, [5], [5], None, kv_hashes([5]))  # outside its grant
            prefill.push_layer(peer, "granted", layer, [2], [2], None, ["kv-of-other-tokens"])
            prefill.push_layer(peer, "granted", layer, [2], [2])  # not bound to any tokens
        assert prefill.flush(10)
        assert not done.wait(1.0)  # wrong blocks do not complete the transfer
        assert not pool.any()
        for layer in range(SHAPE[0]):
            prefill.push_layer(peer, "granted", layer, [2], [2], None, kv_hashes([2]))
        assert prefill.flush(10) and done.wait(10)
        assert outcomes[0].ok, outcomes[0]
        assert torch.equal(pool[:, :, [2]], pattern([2]))
        pool[:, :, [2]] = 0
        assert not pool.any()
        for layer in range(SHAPE[0]):  # a second transfer under the spent grant
            prefill.push_layer(peer, "granted", layer, [2], [2], None, kv_hashes([2]))
        assert prefill.flush(10)
        time.sleep(0.5)  # give a wrongly accepted push time to land
        assert not pool.any()
        assert len(outcomes) == 1
    finally:
        prefill.close()
        decode.close()
