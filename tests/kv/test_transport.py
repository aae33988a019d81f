"""KV transports with plain tensors, sender and receiver in different processes."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from splitserve.config import TransferConfig
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.types import PeerInfo, TransferError
from tests.kv.transport_peer import (
    SHAPE,
    dying_sender,
    filled_pool,
    kv_hashes,
    pattern,
    pull_source,
    receiver,
)

CTX = multiprocessing.get_context("spawn")
SRC, DST = [0, 3, 6], [5, 2, 7]


def _start_receiver(kind: str, timeout_s: float = 10, ttl_s: float = 30):
    to_parent, from_parent = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=receiver, args=(kind, timeout_s, ttl_s, DST, to_parent, from_parent))
    proc.start()
    return proc, PeerInfo(*to_parent.get(timeout=60)), to_parent, from_parent


@pytest.mark.parametrize("kind", ["shm", "tcp"])  # nixl: tests/kv/test_nixl.py, test_pd_connector.py
def test_push_layer_by_layer_lands_in_the_receivers_pool(kind):
    proc, peer, results, release = _start_receiver(kind)
    sender = make_transport("send", TransferConfig(transport=kind, timeout_s=10))
    try:
        filled_pool(sender)
        sender.start()
        for layer in range(SHAPE[0]):
            sender.push_layer(peer, "t1", layer, SRC, DST)
        assert sender.flush(10)
        result, received = results.get(timeout=30)
        assert result["ok"], result
        assert result["num_bytes"] == SHAPE[0] * 2 * len(DST) * 4 * 2 * 5 * 4
        assert result["sender_ready_at"] <= result["last_arrival"]
        assert torch.equal(received, pattern(SRC))
    finally:
        release.put(None)
        proc.join(30)
        sender.close()


# nixl: a killed prefill mid-transfer in tests/router/test_pd_proxy.py, a killed decode in test_nixl.py
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_sender_dying_mid_transfer_times_out(kind):
    proc, peer, results, release = _start_receiver(kind, timeout_s=1.0)
    dying = CTX.Process(target=dying_sender, args=(kind, tuple(peer), SRC, DST, 1))
    try:
        dying.start()
        dying.join(60)
        result, _ = results.get(timeout=30)
        assert not result["ok"]
        assert "stalled" in result["error"]
        assert result["first_arrival"] is not None
    finally:
        release.put(None)
        proc.join(30)


@pytest.mark.parametrize("kind", ["shm", "tcp"])  # nixl: test_prefix_lend.py, test_pd_nixl.py
def test_pull_reads_the_sources_blocks_and_releases_them(kind):
    to_parent, from_parent = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=pull_source, args=(kind, to_parent, from_parent))
    proc.start()
    puller = make_transport("puller", TransferConfig(transport=kind, timeout_s=10))
    try:
        puller.allocate_pool(SHAPE, torch.float32)
        puller.start()
        source = PeerInfo(*to_parent.get(timeout=60))
        outcomes: dict[str, object] = {}
        finished = threading.Event()

        def on_done(result) -> None:
            outcomes[result.transfer_id] = result
            if len(outcomes) == 2:
                finished.set()

        puller.expect("t1", DST, on_done)
        puller.pull(source, "t1", SRC, DST, kv_hashes(SRC))
        puller.expect("gone", [1], on_done)
        puller.pull(source, "gone", [1], [1], kv_hashes([1]))
        assert finished.wait(30)
        assert outcomes["t1"].ok, outcomes["t1"]
        assert torch.equal(puller.pool[:, :, DST], pattern(SRC))
        assert not outcomes["gone"].ok and "no longer holds" in outcomes["gone"].error
        deadline = time.monotonic() + 10
        released: list[str] = []
        while "t1" not in released and time.monotonic() < deadline:
            from_parent.put("report")
            released = to_parent.get(timeout=30)
            time.sleep(0.05)
        assert "t1" in released
    finally:
        from_parent.put(None)
        proc.join(30)
        puller.close()


def test_reservation_ttl_expires_when_nothing_arrives():
    transport = make_transport("lonely", TransferConfig(transport="tcp", reservation_ttl_s=0.3))
    transport.allocate_pool(SHAPE, torch.float32)
    transport.start()
    done = threading.Event()
    results = []
    transport.expect("t1", [1, 2], lambda r: (results.append(r), done.set()))
    try:
        assert done.wait(5)
        assert not results[0].ok and "TTL" in results[0].error
        assert transport.pending_transfers() == 0
    finally:
        transport.close()


def test_back_pressure_then_timeout_when_the_peer_never_answers():
    # a bound socket whose owner never reads: connect succeeds, the handshake never returns
    import zmq

    context = zmq.Context()
    sink = context.socket(zmq.ROUTER)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    sender = make_transport("eager", TransferConfig(transport="tcp", timeout_s=0.5), max_queued_jobs=4)
    filled_pool(sender)
    sender.start()
    try:
        start = time.monotonic()
        with pytest.raises(TransferError):
            for _ in range(50):
                sender.push_layer(PeerInfo("silent", "127.0.0.1", port), "t1", 0, SRC, DST)
        assert time.monotonic() - start < 5
    finally:
        sender.close()
        sink.close(0)
        context.term()


def test_layout_mismatch_is_reported_at_connection_setup():
    receiver_ = make_transport("r", TransferConfig(transport="tcp"))
    receiver_.allocate_pool((2, 2, 4, 4, 2, 5), torch.float32)
    receiver_.start()
    sender = make_transport("s", TransferConfig(transport="tcp", timeout_s=2))
    filled_pool(sender)
    sender.start()
    try:
        sender.push_layer(receiver_.peer_info(), "t1", 0, [0], [0])
        sender.flush(5)
        error = sender.take_send_error("t1")
        assert error and "layouts differ" in error
    finally:
        sender.close()
        receiver_.close()


@pytest.mark.parametrize(("sender_node", "path"), [("node-a", "shm"), ("node-b", "tcp")])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_auto_transport_uses_shm_on_one_node_and_tcp_across_nodes(sender_node, path, mode):
    """`auto`: the receiver on node-a gets the blocks through shared memory from a peer on
    node-a and as tcp frames from one on node-b; either way they land, and its counters say
    which way they came."""
    receiver = make_transport("recv", TransferConfig(transport="auto", timeout_s=10, node_id="node-a"))
    sender = make_transport("send", TransferConfig(transport="auto", timeout_s=10, node_id=sender_node))
    try:
        receiver.allocate_pool(SHAPE, torch.float32)
        filled_pool(sender)
        receiver_peer, sender_peer = receiver.start(), sender.start()
        sender.is_held = lambda transfer_id, blocks, hashes: True
        finished = threading.Event()
        outcome = []
        receiver.expect("t1", DST, lambda result: (outcome.append(result), finished.set()))
        if mode == "push":
            for layer in range(SHAPE[0]):
                sender.push_layer(receiver_peer, "t1", layer, SRC, DST)
        else:
            receiver.pull(sender_peer, "t1", SRC, DST)
        assert finished.wait(30) and outcome[0].ok, outcome
        assert torch.equal(receiver.pool[:, :, DST], pattern(SRC))
        layer_bytes = 2 * len(DST) * 4 * 2 * 5 * 4
        other = "tcp" if path == "shm" else "shm"
        assert receiver.received_by_path() == {path: SHAPE[0] * layer_bytes, other: 0}
    finally:
        sender.close()
        receiver.close()
