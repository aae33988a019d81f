"""The FFN daemon's wire protocol, in process: a layer's answer is the local experts'
output bit for bit, over tcp frames and through shared memory; a replayed message is
dropped; a bad request is refused with a clear error and the daemon keeps serving; a
peer without the token, or offering a segment that is not its own AFD segment, maps
nothing."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator

import pytest
import torch
import zmq

from splitserve.afd.ffn_client import FfnClient
from splitserve.afd.ffn_connection import AfdError
from splitserve.afd.ffn_server import FfnServer
from splitserve.afd.shm_slots import SLOTS, EngineSegment, SlotLayout
from splitserve.afd.wire import afd_mac
from splitserve.kv.transport.frame_mac import SenderSession, hello_stamp
from splitserve.model.loader import load_decoder_config
from splitserve.model.moe import load_experts, route
from splitserve.protocol.afd import HELLO, MOE, AfdProtocolError, FfnLayout, MoeLayerRequest
from tests.conftest import wait_until

TOKEN = "protocol-test-token"
LAYOUT = FfnLayout(64, 8, 2, (0, 1, 2, 3), "bfloat16")  # the tiny bf16 Qwen3-MoE's


@pytest.fixture(scope="module")
def served(tiny_model_factory) -> Iterator[tuple[FfnServer, dict]]:
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, dtype="bfloat16")
    config = load_decoder_config(model_dir)
    experts = load_experts(model_dir, config, torch.bfloat16, torch.device("cpu"))
    server = FfnServer(experts, config, torch.bfloat16, token=TOKEN)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, experts
    server.stop()
    thread.join(timeout=10)


def layer_inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).bfloat16()
    weights, ids = route(torch.randn(tokens, 8, generator=g).bfloat16(), 2, True)
    return x, ids, weights


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_layer_answer_is_the_local_experts_output(served, transport):
    server, experts = served
    client = FfnClient("127.0.0.1", server.port, TOKEN, 10, layout=LAYOUT, transport=transport, slot_tokens=8)
    try:
        assert client.connect().sparse_layers == (0, 1, 2, 3)
        assert (client.segment is not None) == (transport == "shm")
        for tokens, seed in ((5, 1), (1, 2), (0, 3), (8, 9), (9, 10)):  # 9: over a slot, as frames
            x, ids, weights = layer_inputs(tokens, seed)
            sent, received = client.bytes_sent, client.bytes_received
            assert torch.equal(client.compute(2, x, ids, weights), experts[2](x, ids, weights))
            # the tensors each way, whichever path they took
            assert client.bytes_sent - sent == tokens * (64 * 2 + 2 * (4 + 2))
            assert client.bytes_received - received == tokens * 64 * 2
        assert client.shm_layers == (4 if transport == "shm" else 0)
        # both slots in flight at once (two micro-batches), then a third layer as frames
        inputs = [layer_inputs(4, seed) for seed in (11, 12, 13)]
        pending = [client.submit(3, *layer) for layer in inputs]
        assert [p.request.slot for p in pending] == ([0, 1, None] if transport == "shm" else [None] * 3)
        for p, (x, ids, weights) in zip(pending, inputs, strict=True):
            assert torch.equal(client.collect(p), experts[3](x, ids, weights))
        with pytest.raises(AfdError, match="layer 7 is not a sparse layer"):
            client.compute(7, *layer_inputs(3, 4))
        x, ids, weights = layer_inputs(3, 5)
        with pytest.raises(AfdError, match="expected bfloat16 hidden states"):
            client.compute(1, x.float(), ids, weights.float())
        assert torch.equal(client.compute(1, x, ids, weights), experts[1](x, ids, weights))  # still serving
    finally:
        client.close()


def test_a_replayed_message_is_dropped(served):
    server, experts = served
    client = FfnClient("127.0.0.1", server.port, TOKEN, timeout_s=10)
    sent: list[list[bytes]] = []
    try:
        client.connect()
        assert client.socket is not None
        original_send = client.socket.send_multipart

        def recording_send(frames, *args, **kwargs):
            sent.append(list(frames))
            return original_send(frames, *args, **kwargs)

        client.socket.send_multipart = recording_send  # type: ignore[method-assign]
        x, ids, weights = layer_inputs(4, 6)
        client.compute(0, x, ids, weights)
        refused_before = server.refused
        # a captured message sent again on a connection of its own: never answered
        replayer = zmq.Context.instance().socket(zmq.DEALER)
        replayer.setsockopt(zmq.LINGER, 0)
        replayer.connect(f"tcp://127.0.0.1:{server.port}")
        try:
            replayer.send_multipart(sent[-1])
            client.socket.send_multipart = original_send  # type: ignore[method-assign]
            assert wait_until(lambda: server.refused == refused_before + 1, timeout_s=10)
            # the genuine session goes on, and the replay got no answer
            assert torch.equal(client.compute(0, x, ids, weights), experts[0](x, ids, weights))
            assert replayer.poll(0) == 0
        finally:
            replayer.close()
    finally:
        client.close()


@pytest.mark.parametrize("combine", [False, True], ids=["each on its own", "combined"])
def test_requests_of_two_engines_for_one_layer_there_together(tiny_model_factory, combine: bool):
    """Two attention engines' requests for the same layer, there together, answered in one
    pass: by default each computed on its own, bit for bit what its engine computes
    collocated (a matmul's rounding depends on its row count, so a stream's tokens must not
    depend on another engine's rows); with `combine_engines` one grouped expert computation,
    each answered with its own rows, equal to the rows alone up to bf16 rounding."""
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, dtype="bfloat16")
    config = load_decoder_config(model_dir)
    experts = load_experts(model_dir, config, torch.bfloat16, torch.device("cpu"))
    server = FfnServer(experts, config, torch.bfloat16, token=TOKEN, combine_engines=combine)
    # one over shared memory, one over tcp: one batch all the same
    clients = [
        FfnClient("127.0.0.1", server.port, TOKEN, 10, layout=LAYOUT, transport=transport)
        for transport in ("shm", "tcp")
    ]
    try:
        hellos = [threading.Thread(target=c.connect) for c in clients]
        for thread in hellos:
            thread.start()
        assert wait_until(lambda: server.serve_once(100) >= 0 and not any(t.is_alive() for t in hellos))
        server.batch_window_s, server.max_batch_messages = 10.0, 2  # the test waits for both
        inputs = [layer_inputs(tokens, seed) for tokens, seed in ((3, 7), (5, 8))]
        answers: dict[int, torch.Tensor] = {}

        def compute(index: int) -> None:
            answers[index] = clients[index].compute(1, *inputs[index])

        computing = [threading.Thread(target=compute, args=(i,)) for i in range(2)]
        for thread in computing:
            thread.start()
        computed_before = server.layers_computed
        assert server.serve_once(10_000) == 2
        for thread in computing:
            thread.join(timeout=10)
        if combine:
            assert server.layers_computed == computed_before + 1 and server.requests_batched == 2
        else:
            assert server.layers_computed == computed_before + 2 and server.requests_batched == 0
        for index, (x, ids, weights) in enumerate(inputs):
            alone = experts[1](x, ids, weights)
            if combine:
                torch.testing.assert_close(answers[index], alone, rtol=1.6e-2, atol=1e-3)
            else:
                assert torch.equal(answers[index], alone)
        assert [c.shm_layers for c in clients] == [1, 0]
    finally:
        for client in clients:
            client.close()
        server.socket.close()
        server.context.term()


def raw_hello(port: int, token: str, shm: object) -> dict:
    """A HELLO offering `shm`, sealed with `token`, on a connection of its own: the answer."""
    mac = afd_mac(token)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        socket.send_multipart(mac.seal([HELLO, json.dumps({"id": 1, "shm": shm}).encode(), hello_stamp()]))
        assert socket.poll(10_000), "no answer to HELLO"
        return json.loads(socket.recv_multipart()[0])
    finally:
        socket.close()


def test_a_peer_maps_nothing_without_the_token_or_with_a_segment_not_its_own(served, tmp_path):
    server, experts = served
    segment = EngineSegment(SlotLayout(64, 2, torch.bfloat16, SLOTS, 16))
    other_file = os.open(tmp_path / "not-a-segment", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        offer = segment.offer().to_header()
        mapped_before = len(server.segments)
        # a forged HELLO (another deployment's token) is refused before anything is mapped
        assert raw_hello(server.port, "another-token", offer) == {"ok": False, "error": "unauthorized"}
        assert len(server.segments) == mapped_before
        # authenticated, but not a real AFD segment: refused, with the reason, over a live socket
        for forged, reason in (
            ({**offer, "fd": other_file}, "not its KV pool"),  # an open file of this process
            ({**offer, "segment": "afd-0000"}, "not its KV pool"),  # another segment's name
            ({**offer, "slot_tokens": 32}, "not its KV pool"),  # not the size it says
            ({**offer, "node_id": "another-host"}, "another host"),
            ({**offer, "segment": "kv-engine"}, "must be named afd-"),
            ("a segment", "must be an object"),
        ):
            answer = raw_hello(server.port, TOKEN, forged)
            assert answer["ok"] and answer["shm"] is False and reason in answer["shm_error"], answer
        assert raw_hello(server.port, TOKEN, offer)["shm"] is True  # the real one is mapped
    finally:
        os.close(other_file)
        segment.close()
    # an engine that wants shm from a daemon that cannot map its segment fails with the reason
    for transport in ("shm", "auto"):
        far = FfnClient(
            "127.0.0.1", server.port, TOKEN, 10, layout=LAYOUT, transport=transport, node_id="another-host"
        )
        try:
            if transport == "shm":
                with pytest.raises(
                    AfdError, match=r"cannot use this engine's shared memory \(the engine is on"
                ):
                    far.connect()
            else:  # auto: the tensors go over tcp instead
                far.connect()
                x, ids, weights = layer_inputs(3, 14)
                assert torch.equal(far.compute(0, x, ids, weights), experts[0](x, ids, weights))
                assert far.segment is None and far.shm_layers == 0
        finally:
            far.close()


def test_a_slot_is_named_only_on_the_connection_that_offered_its_segment(served):
    """A token holder's MOE naming a slot on a connection with no segment is answered with
    an error (it cannot reach another engine's segment); a slot the segment does not have,
    or more tokens than a slot holds, is refused by the layout."""
    server, _ = served
    mac = afd_mac(TOKEN)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        challenge = hello_stamp()
        socket.send_multipart(mac.seal([HELLO, json.dumps({"id": 1}).encode(), challenge]))
        assert socket.poll(10_000)
        hello = json.loads(mac.open(socket.recv_multipart())[0])
        session = SenderSession()
        session.start(bytes.fromhex(hello["session"]))
        request = MoeLayerRequest(2, 0, 3, 2, "bfloat16", slot=0)
        socket.send_multipart(mac.seal([MOE, json.dumps(request.to_header()).encode(), session.next_stamp()]))
        assert socket.poll(10_000)
        answer = json.loads(mac.open(socket.recv_multipart())[0])
        assert not answer["ok"] and "offered no segment" in answer["error"]
    finally:
        socket.close()
    layout = SlotLayout(64, 2, torch.bfloat16, SLOTS, 16)
    buffer = torch.zeros(layout.total_bytes(), dtype=torch.uint8)
    with pytest.raises(AfdProtocolError, match="slot 2 is not one of"):
        layout.views(buffer, 2, 1)
    with pytest.raises(AfdProtocolError, match="17 tokens do not fit"):
        layout.views(buffer, 1, 17)
