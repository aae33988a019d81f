"""The FFN daemon's wire protocol, in process: a layer's answer is the local experts'
output bit for bit, a replayed message is dropped, a bad request is refused with a clear
error and the daemon keeps serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
import zmq

from splitserve.afd.ffn_client import AfdError, FfnClient
from splitserve.afd.ffn_server import FfnServer
from splitserve.model.loader import load_decoder_config
from splitserve.model.moe import load_experts, route
from tests.conftest import wait_until

TOKEN = "protocol-test-token"


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


def test_a_layer_answer_is_the_local_experts_output(served):
    server, experts = served
    client = FfnClient("127.0.0.1", server.port, TOKEN, timeout_s=10)
    try:
        assert client.connect().sparse_layers == (0, 1, 2, 3)
        for tokens, seed in ((5, 1), (1, 2), (0, 3)):
            x, ids, weights = layer_inputs(tokens, seed)
            assert torch.equal(client.compute(2, x, ids, weights), experts[2](x, ids, weights))
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


def test_requests_of_two_engines_for_one_layer_are_computed_as_one_batch(tiny_model_factory):
    """Two attention engines' requests for the same layer, there together: one grouped
    expert computation, each answered with its own rows (bf16: bit for bit)."""
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, dtype="bfloat16")
    config = load_decoder_config(model_dir)
    experts = load_experts(model_dir, config, torch.bfloat16, torch.device("cpu"))
    server = FfnServer(experts, config, torch.bfloat16, token=TOKEN)
    clients = [FfnClient("127.0.0.1", server.port, TOKEN, timeout_s=10) for _ in range(2)]
    try:
        hellos = [threading.Thread(target=c.connect) for c in clients]
        for thread in hellos:
            thread.start()
        assert wait_until(lambda: server.serve_once(100) >= 0 and all(c.layout for c in clients))
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
        assert server.layers_computed == computed_before + 1 and server.requests_batched == 2
        for index, (x, ids, weights) in enumerate(inputs):
            assert torch.equal(answers[index], experts[1](x, ids, weights))
    finally:
        for client in clients:
            client.close()
        server.socket.close()
        server.context.term()
