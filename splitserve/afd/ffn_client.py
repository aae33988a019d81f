"""The attention engine's side of attention-FFN disaggregation: every sparse MoE layer's
experts are computed by the FFN daemon (ffn_server.py), one request and one reply per
layer (per micro-batch, afd/microbatch.py) of every forward pass, over a ZeroMQ DEALER
socket.

At start-up the client says HELLO (waiting up to the timeout for the daemon to come up)
and checks that the daemon holds this model's experts (hidden size, expert count, top-k,
the sparse layers, the dtype); with the internal token it takes the session the daemon
issues and stamps every later request with it (frame_mac.py's SenderSession), and takes
only a reply sealed with the deployment's key that carries its request's stamp.

A layer is sent (`submit`, which does not wait) and its answer taken (`collect`); several
may be in flight. A daemon that dies (its connection closes) or stops answering (no reply
by the layer's deadline, afd/deadline.py) is connected to again, with a new HELLO, and
every layer in flight is sent again: the daemon keeps no state, so computing a layer
twice is harmless. Only when no daemon answers for the whole timeout does the step fail.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.afd.deadline import DEADLINE_FLOOR_S, ReplyDeadline
from splitserve.afd.wire import afd_mac, dtype_name, tensor_frame, tensor_from_frame
from splitserve.config import AfdConfig
from splitserve.kv.transport.frame_mac import SenderSession, hello_stamp
from splitserve.model.decoder import DecoderModel
from splitserve.model.moe import SparseMoeBlock
from splitserve.protocol.afd import HELLO, MOE, UNAUTHORIZED, FfnLayout, MoeLayerRequest

logger = logging.getLogger(__name__)


class AfdError(RuntimeError):
    """The FFN daemon cannot be reached, refused us, or does not hold this model."""


class DaemonLost(AfdError):
    """The daemon's connection closed (it died, or `up` is starting it again)."""


class DaemonSilent(AfdError):
    """No answer by the layer's deadline: the daemon is stopped or wedged (or very slow)."""


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


@dataclass
class PendingLayer:
    """A layer sent to the daemon whose answer is not taken yet."""

    request: MoeLayerRequest
    data: list[bytes]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    expert_ids: torch.Tensor
    stamp: bytes = b""
    sent_at: float = 0.0  # monotonic, of the latest send
    answer: tuple[dict, list[bytes], float] | None = field(default=None, repr=False)  # + arrival


class FfnClient:
    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        timeout_s: float = 30.0,
        deadline_floor_s: float = DEADLINE_FLOOR_S,
    ) -> None:
        self.address = f"tcp://{host}:{port}"
        self.mac = afd_mac(token)
        self.timeout_s = timeout_s
        self.deadline = ReplyDeadline(timeout_s, min(deadline_floor_s, timeout_s))
        self.context = zmq.Context()
        self.lock = threading.Lock()  # the socket and the layers in flight
        self.ids = itertools.count()
        self.session = SenderSession()
        self.socket: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # the socket's disconnect events
        self.layout: FfnLayout | None = None
        self.in_flight: dict[int, PendingLayer] = {}  # by request id, in the order sent
        # what the layers cost, summed: bytes each way, the round trips (from sending a
        # layer to holding its answer), the daemon's compute within them, and the time the
        # caller was held up sending and waiting (less, with micro-batches, than the trips)
        self.bytes_sent = self.bytes_received = 0
        self.layers = 0
        self.reconnects = 0
        self.deadlines_missed = 0
        self.round_trip_s = self.remote_compute_s = self.blocked_s = 0.0
        self.expert_tokens: list[int] = []  # by expert: the tokens routed to it, all layers

    def connect(self) -> FfnLayout:
        """HELLO: the daemon's layout (AfdError when it does not answer in time or refuses)."""
        with self.lock:
            return self._hello(self.timeout_s)

    def _hello(self, timeout_s: float) -> FfnLayout:
        self._close_socket()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # the daemon's death shows as its connection closing: the layers in flight are sent
        # again to the daemon `up` starts in its place, not waited for until the timeout
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(self.address)
        answer = self._hello_answer(timeout_s)
        try:
            if self.mac.enabled:
                self.session.start(bytes.fromhex(str(answer["session"])))
            layout = FfnLayout.from_header(answer)
        except (KeyError, ValueError) as exc:
            raise AfdError(f"the FFN daemon at {self.address} answered HELLO with {exc!r}") from exc
        if self.layout is not None and layout != self.layout:
            raise AfdError(f"the FFN daemon at {self.address} came back holding {layout}, not {self.layout}")
        self.layout = layout
        if not self.expert_tokens:
            self.expert_tokens = [0] * layout.num_experts
        return layout

    def _hello_answer(self, timeout_s: float) -> dict:
        assert self.socket is not None
        stamp = hello_stamp() if self.mac.enabled else b""
        header = {"id": next(self.ids)}
        self._send_frames([HELLO, json.dumps(header).encode()], stamp)
        deadline = time.monotonic() + timeout_s
        while True:
            frames = self._next_reply(deadline)
            if frames is None:
                self._close_socket()  # what may still arrive belongs to a HELLO given up on
                raise AfdError(f"the FFN daemon at {self.address} did not answer HELLO in {timeout_s:.1f} s")
            reply_stamp, answer, _ = self._open(frames)
            if reply_stamp == stamp and answer.get("id") == header["id"]:
                return answer

    def _close_socket(self) -> None:
        if self.socket is None:
            return
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close()
            self.monitor = None
        self.socket.close()
        self.socket = None

    def _send_frames(self, frames: list[bytes], stamp: bytes) -> None:
        """Sends the sealed message."""
        assert self.socket is not None
        self.socket.send_multipart(self.mac.seal([*frames, stamp] if self.mac.enabled else frames))

    def _send_layer(self, pending: PendingLayer) -> None:
        pending.stamp = self.session.next_stamp() if self.mac.enabled else b""
        pending.answer = None
        header = json.dumps(pending.request.to_header()).encode()
        self._send_frames([MOE, header, *pending.data], pending.stamp)
        # the tensors alone count (hidden states and routing out, the experts' output back):
        # headers carry timings whose length varies, and a HELLO's layout is no layer traffic
        self.bytes_sent += sum(len(f) for f in pending.data)
        pending.sent_at = time.monotonic()

    def _next_reply(self, deadline: float) -> list[bytes] | None:
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
                self._close_socket()
                raise DaemonLost(f"the FFN daemon at {self.address} closed the connection")
        return None

    def _open(self, reply: list[bytes]) -> tuple[bytes, dict, list[bytes]]:
        """A reply's stamp (that of the request it answers; b"" without a token), header
        and data frames; AfdError for a refusal or a reply not sealed with our key."""
        body = self.mac.open(reply)
        if body is None:
            raise AfdError(self._refusal(reply))
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
            raise AfdError(self._refusal(reply))
        if not answer.get("ok"):
            raise AfdError(f"the FFN daemon at {self.address} refused a request: {answer.get('error')}")
        return stamp, answer, body[1:]

    def _refusal(self, reply: list[bytes]) -> str:
        try:
            unauthorized = json.loads(reply[0]).get("error") == UNAUTHORIZED
        except (ValueError, AttributeError, IndexError):
            unauthorized = False
        if unauthorized:
            return (
                f"the FFN daemon at {self.address} refused this engine: not this deployment's internal token"
            )
        return f"a reply from {self.address} failed authentication (not this deployment's FFN daemon)"

    def _take_reply(self, deadline: float) -> None:
        """Wait for one message and file it with the layer in flight it answers (a late
        answer to an earlier send is dropped); DaemonSilent when none comes by the deadline."""
        frames = self._next_reply(deadline)
        if frames is None:
            raise DaemonSilent(f"the FFN daemon at {self.address} has not answered in time")
        stamp, answer, data = self._open(frames)
        answer_id = answer.get("id")
        pending = self.in_flight.get(answer_id) if isinstance(answer_id, int) else None
        if pending is not None and pending.answer is None and pending.stamp == stamp:
            pending.answer = (answer, data, time.monotonic())
            self.bytes_received += sum(len(f) for f in data)

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
        request = MoeLayerRequest(next(self.ids), layer, x.shape[0], expert_ids.shape[1], dtype_name(x.dtype))
        data = [tensor_frame(x), tensor_frame(expert_ids.to(torch.int32)), tensor_frame(expert_weights)]
        pending = PendingLayer(request, data, tuple(x.shape), x.dtype, x.device, expert_ids)
        with self.lock:
            started = time.perf_counter()
            try:
                self.in_flight[request.id] = pending
                if self.socket is None:  # a step failed, or a layer was given up on: a new session
                    self._reconnect()  # sends the pending one too
                else:
                    self._send_layer(pending)
            except AfdError:
                self._forget()
                raise
            finally:
                self.blocked_s += time.perf_counter() - started
        return pending

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
                if self.socket is None:
                    self._reconnect()
                deadline = pending.sent_at + patience * self.deadline.for_layer(request.num_tokens)
                self._take_reply(deadline)
            except (DaemonLost, DaemonSilent) as exc:
                self._close_socket()
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
        if len(frames) != 1 or answer.get("num_tokens") != request.num_tokens:
            raise AfdError(f"the FFN daemon's answer for layer {request.layer} does not match the request")
        try:
            combined = tensor_from_frame(frames[0], pending.dtype, pending.shape).to(pending.device)
        except ValueError as exc:
            raise AfdError(f"the FFN daemon's answer for layer {request.layer}: {exc}") from exc
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
        self._close_socket()

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
        )

    def close(self) -> None:
        with self.lock:
            self._close_socket()
            self.context.term()


class RemoteExperts:
    """One sparse layer's experts, computed by the FFN daemon (SparseMoeBlock.remote_experts)."""

    def __init__(self, client: FfnClient, layer: int) -> None:
        self.client, self.layer = client, layer

    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.client.compute(self.layer, x, expert_ids, expert_weights)


def attach_ffn(model: DecoderModel, afd: AfdConfig, dtype: torch.dtype, token: str | None) -> FfnClient:
    """Connect to the FFN daemon, check it holds this model's experts, and route every
    sparse layer of `model` to it. AfdError when it cannot."""
    moe = model.config.moe
    if moe is None:
        raise AfdError("attention-FFN disaggregation needs a mixture-of-experts model")
    client = FfnClient(afd.ffn_host, afd.ffn_port, token, afd.timeout_s)
    try:
        layout = client.connect()
        sparse = tuple(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock))
        ours = FfnLayout(model.config.hidden_size, moe.num_experts, moe.top_k, sparse, dtype_name(dtype))
        if layout != ours:
            raise AfdError(f"the FFN daemon at {client.address} holds {layout}, this engine needs {ours}")
    except (AfdError, ValueError, KeyError) as exc:
        client.close()
        raise AfdError(str(exc)) from exc
    for i in sparse:
        block = model.layers[i].mlp
        assert isinstance(block, SparseMoeBlock)
        block.remote_experts = RemoteExperts(client, i)
    return client
