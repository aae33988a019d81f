"""The attention engine's side of attention-FFN disaggregation: every sparse MoE layer's
experts are computed by the FFN daemon (ffn_server.py), one request and one reply per
layer (per micro-batch, afd/microbatch.py) of every forward pass, over a ZeroMQ DEALER
socket (the connection: afd/ffn_connection.py).

At start-up the client says HELLO (waiting up to the timeout for the daemon to come up)
and checks that the daemon holds this model's experts (hidden size, expert count, top-k,
the sparse layers, the dtype); with the internal token it takes the session the daemon
issues and stamps every later request with it (frame_mac.py's SenderSession), and takes
only a reply sealed with the deployment's key that carries its request's stamp.

The tensors travel as frames on that socket (tcp), or, with a daemon on the same host,
through a shared-memory segment this engine offers in its HELLO (afd/shm_slots.py; only
the sealed header crosses the socket): `transport` says which (auto: shm when the
daemon can map the segment, tcp otherwise; shm: refused at HELLO when it cannot).

A layer is sent (`submit`, which does not wait) and its answer taken (`collect`); several
may be in flight. A daemon that dies (its connection closes) or stops answering (no reply
by the layer's deadline, afd/deadline.py) is connected to again, with a new HELLO, and
every layer in flight is sent again: the daemon keeps no state, so computing a layer
twice is harmless. Only when no daemon answers for the whole timeout does the step fail.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from splitserve.afd.deadline import DEADLINE_FLOOR_S, ReplyDeadline
from splitserve.afd.ffn_connection import AfdError, DaemonLost, DaemonSilent, FfnConnection
from splitserve.afd.shm_slots import SLOTS, EngineSegment
from splitserve.afd.wire import dtype_name, tensor_frame, tensor_from_frame
from splitserve.config import AfdConfig
from splitserve.model.decoder import DecoderModel
from splitserve.model.moe import SparseMoeBlock
from splitserve.protocol.afd import MOE, FfnLayout, MoeLayerRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AfdTotals:
    bytes_sent: int
    bytes_received: int
    layers: int
    reconnects: int  # layers sent again
    round_trip_s: float
    remote_compute_s: float
    blocked_s: float  # the caller's time in submit and collect: what no overlap hid
    deadlines_missed: int
    expert_tokens: tuple[int, ...]  # by expert
    shm_layers: int  # layers whose tensors went through shared memory


@dataclass
class PendingLayer:
    """A layer sent to the daemon whose answer is not taken yet."""

    request: MoeLayerRequest  # its slot: where it goes when shared memory is in use
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden, ids (int32), weights
    device: torch.device
    expert_ids: torch.Tensor
    stamp: bytes = b""
    sent_at: float = 0.0  # monotonic, of the latest send
    in_slot: bool = False  # the latest send went through the shared-memory segment
    answer: tuple[dict, list[bytes], float] | None = field(default=None, repr=False)  # + arrival


class FfnClient:
    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        timeout_s: float = 30.0,
        deadline_floor_s: float = DEADLINE_FLOOR_S,
        layout: FfnLayout | None = None,  # what this engine needs; None: whatever the daemon holds
        transport: str = "tcp",
        slot_tokens: int = 2048,  # a shared-memory slot's room; a larger layer goes as frames
        node_id: str | None = None,  # this host's identity for shm (None: its boot ID)
    ) -> None:
        if transport != "tcp" and layout is None:
            raise ValueError("a shared-memory AFD transport needs the model's layout to size its segment")
        self.address = f"tcp://{host}:{port}"
        self.connection = FfnConnection(self.address, token, transport, slot_tokens, node_id)
        self.timeout_s = timeout_s
        self.deadline = ReplyDeadline(timeout_s, min(deadline_floor_s, timeout_s))
        self.lock = threading.Lock()  # the connection and the layers in flight
        self.ids = itertools.count()
        self.layout: FfnLayout | None = layout
        self.in_flight: dict[int, PendingLayer] = {}  # by request id, in the order sent
        # what the layers cost, summed: bytes each way, the round trips (from sending a
        # layer to holding its answer), the daemon's compute within them, and the time the
        # caller was held up sending and waiting (less, with micro-batches, than the trips)
        self.bytes_sent = self.bytes_received = 0
        self.layers = 0
        self.reconnects = 0
        self.deadlines_missed = 0
        self.shm_layers = 0
        self.round_trip_s = self.remote_compute_s = self.blocked_s = 0.0
        self.expert_tokens: list[int] = []  # by expert: the tokens routed to it, all layers

    def connect(self) -> FfnLayout:
        """HELLO: the daemon's layout (AfdError when it does not answer in time or refuses)."""
        with self.lock:
            return self._hello(self.timeout_s)

    @property
    def socket(self) -> zmq.Socket | None:
        return self.connection.socket

    @property
    def segment(self) -> EngineSegment | None:
        return self.connection.segment

    def _hello(self, timeout_s: float) -> FfnLayout:
        self.layout = self.connection.hello(timeout_s, self.layout)
        if not self.expert_tokens:
            self.expert_tokens = [0] * self.layout.num_experts
        return self.layout

    def _send_layer(self, pending: PendingLayer) -> None:
        pending.stamp = self.connection.next_stamp()
        pending.answer = None
        request, data = pending.request, []
        pending.in_slot = self.segment is not None and request.slot is not None
        if self.segment is not None and request.slot is not None:
            views = self.segment.views(request.slot, request.num_tokens)
            for target, source in zip((views.x, views.ids, views.weights), pending.tensors, strict=True):
                target.copy_(source)
        else:  # no segment (tcp, or a daemon that could not map it) or no free slot: frames
            request = dataclasses.replace(request, slot=None)
            data = [tensor_frame(t) for t in pending.tensors]
        self.connection.send([MOE, json.dumps(request.to_header()).encode(), *data], pending.stamp)
        # the tensors alone count (hidden states and routing out, the experts' output back),
        # whichever way they went: headers carry timings whose length varies, and a HELLO's
        # layout is no layer traffic
        self.bytes_sent += sum(t.nbytes for t in pending.tensors)
        pending.sent_at = time.monotonic()

    def _take_reply(self, deadline: float) -> None:
        """Wait for one message and file it with the layer in flight it answers (a late
        answer to an earlier send is dropped); DaemonSilent when none comes by the deadline."""
        frames = self.connection.next_reply(deadline)
        if frames is None:
            raise DaemonSilent(f"the FFN daemon at {self.address} has not answered in time")
        stamp, answer, data = self.connection.open_reply(frames)
        answer_id = answer.get("id")
        pending = self.in_flight.get(answer_id) if isinstance(answer_id, int) else None
        if pending is not None and pending.answer is None and pending.stamp == stamp:
            pending.answer = (answer, data, time.monotonic())

    def _reconnect(self) -> None:
        """A new connection (HELLO) and every layer in flight sent again on it, waiting up
        to the whole timeout for a daemon to answer (one `up` is starting meanwhile)."""
        lost_at = time.monotonic()
        while True:
            try:
                self._hello(max(0.001, self.timeout_s - (time.monotonic() - lost_at)))
                for pending in self.in_flight.values():
                    self._send_layer(pending)
                return
            except DaemonLost as exc:
                if time.monotonic() - lost_at > self.timeout_s:
                    raise AfdError(f"{exc}, and no daemon came back in {self.timeout_s:.0f} s") from exc

    def submit(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> PendingLayer:
        """Send `layer`'s tokens to the daemon; `collect` takes the answer."""
        tensors = (x.detach(), expert_ids.to(torch.int32), expert_weights.detach())
        with self.lock:
            started = time.perf_counter()
            request = MoeLayerRequest(
                next(self.ids),
                layer,
                x.shape[0],
                expert_ids.shape[1],
                dtype_name(x.dtype),
                self._free_slot(x.shape[0]),
            )
            pending = PendingLayer(request, tensors, x.device, expert_ids)
            try:
                self.in_flight[request.id] = pending
                if not self.connection.open:  # a step failed, or a layer was given up on: a new session
                    self._reconnect()  # sends the pending one too
                else:
                    self._send_layer(pending)
            except AfdError:
                self._forget()
                raise
            finally:
                self.blocked_s += time.perf_counter() - started
        return pending

    def _free_slot(self, num_tokens: int) -> int | None:
        """A shared-memory slot no layer in flight holds (None: the layer goes as frames)."""
        if self.connection.transport == "tcp" or num_tokens > self.connection.slot_tokens:
            return None
        taken = {pending.request.slot for pending in self.in_flight.values()}
        return next((slot for slot in range(SLOTS) if slot not in taken), None)

    def collect(self, pending: PendingLayer) -> torch.Tensor:
        """The combined expert output of a submitted layer: [T, H] in its dtype."""
        with self.lock:
            started = time.perf_counter()
            try:
                return self._collect(pending)
            except AfdError:
                self._forget()
                raise
            finally:
                self.blocked_s += time.perf_counter() - started

    def _collect(self, pending: PendingLayer) -> torch.Tensor:
        request = pending.request
        if request.id not in self.in_flight:
            raise AfdError(f"layer {request.layer} was not submitted, or its answer was taken")
        patience = 1.0  # grows each time the daemon misses a deadline yet comes back
        given_up_at: float | None = None
        while pending.answer is None:
            try:
                if not self.connection.open:
                    self._reconnect()
                deadline = pending.sent_at + patience * self.deadline.for_layer(request.num_tokens)
                self._take_reply(deadline)
            except (DaemonLost, DaemonSilent) as exc:
                self.connection.close()
                given_up_at = given_up_at if given_up_at is not None else time.monotonic()
                if time.monotonic() - given_up_at > self.timeout_s:
                    raise AfdError(f"{exc}, and no daemon answered in {self.timeout_s:.0f} s") from exc
                if isinstance(exc, DaemonSilent):
                    self.deadlines_missed += 1
                    patience *= 2  # a daemon only slow gets more time on every try
                self.reconnects += len(self.in_flight)
                logger.warning("%s; sending %d layers again", exc, len(self.in_flight))
        answer, frames, arrived = pending.answer
        del self.in_flight[request.id]
        if len(frames) != (0 if pending.in_slot else 1) or answer.get("num_tokens") != request.num_tokens:
            raise AfdError(f"the FFN daemon's answer for layer {request.layer} does not match the request")
        x = pending.tensors[0]
        if pending.in_slot:
            assert self.segment is not None and request.slot is not None
            combined = self.segment.views(request.slot, request.num_tokens).out.to(pending.device, copy=True)
            self.shm_layers += 1
        else:
            try:
                combined = tensor_from_frame(frames[0], x.dtype, tuple(x.shape)).to(pending.device)
            except ValueError as exc:
                raise AfdError(f"the FFN daemon's answer for layer {request.layer}: {exc}") from exc
        self.bytes_received += combined.nbytes
        compute_s = answer.get("compute_s")
        compute = float(compute_s) if isinstance(compute_s, (int, float)) else 0.0
        self.layers += 1
        self.round_trip_s += arrived - pending.sent_at
        self.remote_compute_s += compute
        self.deadline.observe(arrived - pending.sent_at, compute, request.num_tokens)
        counts = torch.bincount(pending.expert_ids.flatten().cpu(), minlength=len(self.expert_tokens))
        self.expert_tokens = [a + b for a, b in zip(self.expert_tokens, counts.tolist(), strict=True)]
        return combined

    def _forget(self) -> None:
        """After a failed step: nothing of it is sent again, and the next layer says HELLO."""
        self.in_flight.clear()
        self.connection.close()

    def abandon(self) -> None:
        """The layers in flight are no longer wanted (their step failed elsewhere): their
        answers, if they come, are dropped, and a reconnect does not send them again."""
        with self.lock:
            self.in_flight.clear()

    def compute(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The combined expert output of `layer` for these tokens: [T, H] in x's dtype."""
        return self.collect(self.submit(layer, x, expert_ids, expert_weights))

    def totals(self) -> AfdTotals:
        """What the layers have cost so far (afd/metrics.py takes the differences per step).
        Not under the lock, which a layer waiting for a silent daemon holds: each counter
        is read whole, and only the thread holding the lock writes them."""
        return AfdTotals(
            self.bytes_sent,
            self.bytes_received,
            self.layers,
            self.reconnects,
            self.round_trip_s,
            self.remote_compute_s,
            self.blocked_s,
            self.deadlines_missed,
            tuple(self.expert_tokens),
            self.shm_layers,
        )

    def close(self) -> None:
        with self.lock:
            self.connection.terminate()


class RemoteExperts:
    """One sparse layer's experts, computed by the FFN daemon (SparseMoeBlock.remote_experts)."""

    def __init__(self, client: FfnClient, layer: int) -> None:
        self.client, self.layer = client, layer

    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.client.compute(self.layer, x, expert_ids, expert_weights)


def attach_ffn(
    model: DecoderModel, afd: AfdConfig, dtype: torch.dtype, token: str | None, max_step_tokens: int
) -> FfnClient:
    """Connect to the FFN daemon, check it holds this model's experts, and route every
    sparse layer of `model` to it (`max_step_tokens`: the most a forward pass carries, the
    room of a shared-memory slot). AfdError when it cannot."""
    moe = model.config.moe
    if moe is None:
        raise AfdError("attention-FFN disaggregation needs a mixture-of-experts model")
    sparse = tuple(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock))
    shared = moe.shared_expert_intermediate_size > 0
    ours = FfnLayout(model.config.hidden_size, moe.num_experts, moe.top_k, sparse, dtype_name(dtype), shared)
    client = FfnClient(
        afd.ffn_host,
        afd.ffn_port,
        token,
        afd.timeout_s,
        layout=ours,
        transport=afd.transport,
        slot_tokens=max_step_tokens,
    )
    try:
        client.connect()
    except (AfdError, ValueError, KeyError) as exc:
        client.close()
        raise AfdError(str(exc)) from exc
    for i in sparse:
        block = model.layers[i].mlp
        assert isinstance(block, SparseMoeBlock)
        block.remote_experts = RemoteExperts(client, i)
    return client
