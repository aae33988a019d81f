"""An FFN daemon alive but silent (its loop not turning: what SIGSTOP or a wedge does): the
layer's answer misses its deadline (derived from the daemon's measured compute, with a
floor), the client connects again and sends the layer again, and takes the right answer
once the daemon turns again; `up`'s liveness probe (PING) tells a turning daemon from a
silent one. In process, over real sockets; the test_up_afd.py test SIGSTOPs a real one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import zmq

from splitserve.afd.deadline import ReplyDeadline
from splitserve.afd.ffn_client import FfnClient
from splitserve.afd.ffn_server import FfnServer
from splitserve.deploy.liveness import ffn_answers
from splitserve.model.loader import load_decoder_config
from splitserve.model.moe import Experts, load_experts
from tests.afd.test_ffn_protocol import layer_inputs
from tests.conftest import wait_until

TOKEN = "stuck-test-token"


@dataclass
class PausableDaemon:
    """A real FfnServer whose loop the test can hold (as SIGSTOP holds a process)."""

    server: FfnServer
    experts: dict[int, Experts]
    serving: threading.Event
    paused: threading.Event
    done: threading.Event

    def loop(self) -> None:
        while not self.done.is_set():
            if self.serving.is_set():
                self.paused.clear()
                self.server.serve_once(20)
            else:
                self.paused.set()
                self.serving.wait(0.05)

    def hold(self) -> None:
        self.serving.clear()
        assert self.paused.wait(10)  # the loop is out of serve_once: nothing is answered


@pytest.fixture
def daemon(tiny_model_factory) -> Iterator[PausableDaemon]:
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, dtype="bfloat16")
    config = load_decoder_config(model_dir)
    experts = load_experts(model_dir, config, torch.bfloat16, torch.device("cpu"))
    server = FfnServer(experts, config, torch.bfloat16, token=TOKEN)
    daemon = PausableDaemon(server, experts, threading.Event(), threading.Event(), threading.Event())
    daemon.serving.set()
    thread = threading.Thread(target=daemon.loop, daemon=True)
    thread.start()
    yield daemon
    daemon.done.set()
    daemon.serving.set()
    thread.join(timeout=10)
    server.socket.close()
    server.context.term()


def test_a_silent_daemon_misses_the_deadline_and_the_layer_is_sent_again(daemon):
    client = FfnClient("127.0.0.1", daemon.server.port, TOKEN, timeout_s=20, deadline_floor_s=0.3)
    context = zmq.Context()
    url = f"tcp://127.0.0.1:{daemon.server.port}"
    try:
        client.connect()
        for seed in range(4):  # answered layers: what the deadline is derived from
            client.compute(1, *layer_inputs(3, seed))
        assert client.deadline.for_layer(3) < 20  # no longer the whole timeout
        assert ffn_answers(context, url)
        daemon.hold()
        assert not ffn_answers(context, url)
        x, ids, weights = layer_inputs(5, 9)
        answers: list[torch.Tensor] = []
        waiting = threading.Thread(target=lambda: answers.append(client.compute(2, x, ids, weights)))
        waiting.start()
        assert wait_until(lambda: client.totals().deadlines_missed >= 1, timeout_s=10)
        assert not answers  # still waiting: for a daemon to answer at the address
        daemon.serving.set()
        waiting.join(timeout=20)
        assert answers and torch.equal(answers[0], daemon.experts[2](x, ids, weights))
        totals = client.totals()
        assert totals.reconnects >= 1 and totals.layers == 5
        assert torch.equal(client.compute(0, x, ids, weights), daemon.experts[0](x, ids, weights))
    finally:
        client.close()
        context.term()


def test_two_layers_in_flight_are_both_sent_again(daemon):
    """Micro-batches have two layers in flight: a silent daemon's reconnect sends both."""
    client = FfnClient("127.0.0.1", daemon.server.port, TOKEN, timeout_s=20, deadline_floor_s=0.3)
    try:
        client.connect()
        client.compute(1, *layer_inputs(2, 0))
        daemon.hold()
        inputs = [layer_inputs(3, 10), layer_inputs(4, 11)]
        pending = [client.submit(3, *inputs[0]), client.submit(3, *inputs[1])]
        answers: list[torch.Tensor] = []

        def collect_both() -> None:
            answers.extend(client.collect(p) for p in pending)

        waiting = threading.Thread(target=collect_both)
        waiting.start()
        assert wait_until(lambda: client.totals().reconnects >= 2, timeout_s=10)
        daemon.serving.set()
        waiting.join(timeout=20)
        assert len(answers) == 2
        for answer, (x, ids, weights) in zip(answers, inputs, strict=True):
            assert torch.equal(answer, daemon.experts[3](x, ids, weights))
    finally:
        client.close()


def test_the_deadline_follows_the_daemons_measured_times():
    deadline = ReplyDeadline(timeout_s=30, floor_s=1.0, factor=8)
    assert deadline.for_layer(1) == 30  # nothing measured yet
    deadline.observe(round_trip_s=0.002, compute_s=0.001, num_tokens=10)
    assert deadline.for_layer(1) == 1.0  # the floor
    deadline.observe(round_trip_s=0.05, compute_s=0.04, num_tokens=4)  # 10 ms a token
    assert deadline.for_layer(100) == pytest.approx(8 * (0.05 + 0.01 * 100))
    assert deadline.for_layer(10_000) == 30  # never over the whole timeout
    with pytest.raises(ValueError, match="deadline floor"):
        ReplyDeadline(timeout_s=1, floor_s=2)
