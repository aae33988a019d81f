"""The attention engine's side of attention-FFN disaggregation: every sparse MoE layer's
experts are computed by the FFN daemon (ffn_server.py), one request and one reply per
layer of every forward pass, over a ZeroMQ DEALER socket.

At start-up the client says HELLO (waiting up to the timeout for the daemon to come up)
and checks that the daemon holds this model's experts (hidden size, expert count, top-k,
the sparse layers, the dtype); with the internal token it takes the session the daemon
issues and stamps every later request with it (frame_mac.py's SenderSession), and takes
only a reply sealed with the deployment's key that carries its request's stamp.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

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


@dataclass(frozen=True)
class AfdTotals:
    bytes_sent: int
    bytes_received: int
    layers: int
    reconnects: int
    round_trip_s: float
    remote_compute_s: float
    expert_tokens: tuple[int, ...]  # by expert


class FfnClient:
    def __init__(self, host: str, port: int, token: str | None, timeout_s: float = 30.0) -> None:
        self.address = f"tcp://{host}:{port}"
        self.mac = afd_mac(token)
        self.timeout_ms = int(timeout_s * 1000)
        self.context = zmq.Context()
        self.lock = threading.Lock()  # one request in flight
        self.ids = itertools.count()
        self.session = SenderSession()
        self.socket: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # the socket's disconnect events
        self.layout: FfnLayout | None = None
        # what the layers cost, summed: bytes each way, the round trips (from sending a
        # layer to holding its answer) and the daemon's compute within them; the
        # difference is the communication the attention engine waits for
        self.bytes_sent = self.bytes_received = 0
        self.layers = 0
        self.reconnects = 0  # layers sent again to a daemon that came back
        self.round_trip_s = self.remote_compute_s = 0.0
        self.expert_tokens: list[int] = []  # by expert: the tokens routed to it, all layers

    def connect(self) -> FfnLayout:
        """HELLO: the daemon's layout (AfdError when it does not answer in time or refuses)."""
        with self.lock:
            return self._hello()

    def _hello(self) -> FfnLayout:
        self._close_socket()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # the daemon's death shows as its connection closing: the layer is sent again to
        # the daemon `up` starts in its place, not waited for until the timeout
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(self.address)
        answer, _ = self._request(HELLO, {"id": next(self.ids)}, [], hello_stamp())
        if self.mac.enabled:
            self.session.start(bytes.fromhex(str(answer["session"])))
        layout = FfnLayout.from_header(answer)
        if self.layout is not None and layout != self.layout:
            raise AfdError(f"the FFN daemon at {self.address} came back holding {layout}, not {self.layout}")
        self.layout = layout
        if not self.expert_tokens:
            self.expert_tokens = [0] * layout.num_experts
        return layout

    def _close_socket(self) -> None:
        if self.socket is None:
            return
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close()
            self.monitor = None
        self.socket.close()
        self.socket = None

    def _request(
        self, kind: bytes, header: dict, data: list[bytes], stamp: bytes
    ) -> tuple[dict, list[bytes]]:
        assert self.socket is not None and self.monitor is not None
        frames = [kind, json.dumps(header).encode(), *data]
        if self.mac.enabled:
            frames.append(stamp)
        sealed = self.mac.seal(frames)
        self.socket.send_multipart(sealed)
        self.bytes_sent += sum(len(f) for f in sealed)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while (left_s := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left_s * 1000))
            if self.socket not in ready:
                if (
                    self.monitor in ready
                    and recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
                ):
                    self._close_socket()
                    raise DaemonLost(f"the FFN daemon at {self.address} closed the connection")
                continue
            reply = self.socket.recv_multipart()
            self.bytes_received += sum(len(f) for f in reply)
            body = self.mac.open(reply)
            if body is None:
                raise AfdError(self._refusal(reply))
            if self.mac.enabled:
                if len(body) < 2 or body[-1] != stamp:
                    continue  # the late answer to a request that timed out
                body = body[:-1]
            answer = json.loads(body[0])
            if answer.get("error") == UNAUTHORIZED:  # we have no token, the daemon has one
                raise AfdError(self._refusal(reply))
            if answer.get("id") != header["id"]:
                continue
            if not answer.get("ok"):
                raise AfdError(
                    f"the FFN daemon at {self.address} refused {kind.decode()}: {answer.get('error')}"
                )
            return answer, body[1:]
        self._close_socket()  # what may still arrive belongs to a request given up on
        raise AfdError(
            f"the FFN daemon at {self.address} did not answer {kind.decode()} in {self.timeout_ms} ms"
        )

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

    def compute(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The combined expert output of `layer` for these tokens: [T, H] in x's dtype."""
        request = MoeLayerRequest(next(self.ids), layer, x.shape[0], expert_ids.shape[1], dtype_name(x.dtype))
        data = [tensor_frame(x), tensor_frame(expert_ids.to(torch.int32)), tensor_frame(expert_weights)]
        with self.lock:
            started = time.perf_counter()
            lost_at: float | None = None
            while True:
                try:
                    if self.socket is None:  # a request timed out or the daemon went: a new session
                        self._hello()
                    stamp = self.session.next_stamp() if self.mac.enabled else b""
                    answer, frames = self._request(MOE, request.to_header(), data, stamp)
                    break
                except DaemonLost as exc:  # computing a layer again is harmless: the daemon keeps no state
                    lost_at = lost_at if lost_at is not None else time.monotonic()
                    if time.monotonic() - lost_at > self.timeout_ms / 1000:
                        raise AfdError(f"{exc}, and no daemon came back in {self.timeout_ms} ms") from exc
                    self.reconnects += 1
                    logger.warning("%s; sending layer %d again once it is back", exc, layer)
            if len(frames) != 1 or answer.get("num_tokens") != x.shape[0]:
                raise AfdError(f"the FFN daemon's answer for layer {layer} does not match the request")
            combined = tensor_from_frame(frames[0], x.dtype, tuple(x.shape)).to(x.device)
            self.layers += 1
            self.round_trip_s += time.perf_counter() - started
            compute_s = answer.get("compute_s")
            self.remote_compute_s += float(compute_s) if isinstance(compute_s, (int, float)) else 0.0
            counts = torch.bincount(expert_ids.flatten().cpu(), minlength=len(self.expert_tokens)).tolist()
            self.expert_tokens = [a + b for a, b in zip(self.expert_tokens, counts, strict=True)]
        return combined

    def totals(self) -> AfdTotals:
        """What the layers have cost so far (afd/metrics.py takes the differences per step)."""
        with self.lock:
            return AfdTotals(
                self.bytes_sent,
                self.bytes_received,
                self.layers,
                self.reconnects,
                self.round_trip_s,
                self.remote_compute_s,
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
