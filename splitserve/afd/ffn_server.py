"""`splitserve engine MODEL --role ffn`: the FFN daemon of attention-FFN disaggregation.

It holds only a MoE model's experts (no attention, no scheduler, no KV cache) and answers
one message per sparse layer of every forward pass of its attention engine: the layer's
post-attention hidden states and the router's top-k ids and weights in, the combined
expert output out (protocol/afd.py). One ZeroMQ ROUTER socket, one thread. Several
attention engines may share the daemon (`up --afd 2:1`): what has arrived when it turns
to the socket is taken together and answered in one pass. Each request is computed on its
own by default, as its engine would compute it collocated: a matmul's rounding depends
on its row count (through the tiny Qwen3-MoE's experts in bfloat16, a token alone and the
same token beside another differed in the last bit for 2 of 500 random tokens; in
float32 nearly always), so rows of two engines
computed together would make a stream's tokens depend on what another engine was doing
at the same layer. `--ffn-combine-engines` (`combine_engines`) computes the requests for
the same layer as one batch instead (their tokens concatenated: one grouped expert
computation, each answered with its own rows): fewer, larger matmuls, for a daemon whose
engines' outputs need not equal the collocated engine's bit for bit. Nothing waits for a
batch to fill unless `batch_window_s` says so.

Authentication reuses the KV transport's pieces (kv/transport/frame_mac.py): every
message is sealed with a MAC derived from the deployment's internal token under the AFD
label; HELLO gets a session, and each later message of that session must carry a higher
sequence number (ReplayGuard), so a captured message sent again is dropped. A message
that fails the MAC is answered untagged {"ok": false, "error": "unauthorized"}.

Over shared memory (an engine on this host that offered its segment in an authenticated
HELLO, afd/shm_slots.py) a MOE message names a slot of that segment instead of carrying
data frames: the tensors are read from the slot and the output written into it, and the
answer is the header alone. The segment is the connection's: a request on another
connection cannot name it.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import torch
import zmq

from splitserve.afd.shm_slots import PeerSegment, map_engine_segment
from splitserve.afd.wire import DTYPES, afd_mac, dtype_name, tensor_frame, tensor_from_frame
from splitserve.kv.transport.frame_mac import ReplayGuard
from splitserve.kv.transport.types import TransferError
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.moe import ExpertLayer
from splitserve.protocol.afd import (
    HELLO,
    MOE,
    PING,
    PONG,
    UNAUTHORIZED,
    AfdProtocolError,
    FfnLayout,
    MoeLayerRequest,
    ShmOffer,
)

logger = logging.getLogger(__name__)

POLL_MS = 100
MAX_MESSAGE_BYTES = 1 << 30
MAX_BATCH_MESSAGES = 64
MAX_SEGMENTS = 64  # engines' segments mapped at once (a reconnect brings a new one)


@dataclass(frozen=True)
class LayerWork:
    """One admitted MOE request, its tensors decoded and checked."""

    identity: bytes
    stamp: bytes
    request: MoeLayerRequest
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None  # where the output goes in the engine's segment; None: a frame


class FfnServer:
    def __init__(
        self,
        experts: dict[int, ExpertLayer],  # by layer index (routed and shared experts)
        config: DecoderConfig,
        dtype: torch.dtype,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        batch_window_s: float = 0.0,  # how long to wait for more messages after the first
        max_batch_messages: int = MAX_BATCH_MESSAGES,
        combine_engines: bool = False,  # one grouped computation for a layer's requests
    ) -> None:
        assert config.moe is not None
        self.batch_window_s, self.max_batch_messages = batch_window_s, max_batch_messages
        self.combine_engines = combine_engines
        self.experts, self.dtype = experts, dtype
        self.layout = FfnLayout(
            config.hidden_size,
            config.moe.num_experts,
            config.moe.top_k,
            tuple(sorted(experts)),
            dtype_name(dtype),
            config.moe.shared_expert_intermediate_size > 0,
        )
        self.mac = afd_mac(token)
        self.sessions = ReplayGuard()
        # by connection (ROUTER identity), least recently offered first
        self.segments: OrderedDict[bytes, PeerSegment] = OrderedDict()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.stopping = threading.Event()
        self.layers_computed = 0  # grouped expert computations
        self.requests_batched = 0  # requests computed in a batch with another engine's
        self.refused = 0

    def serve_forever(self) -> None:
        """Answer messages until stop() (or SIGINT/SIGTERM in the CLI)."""
        try:
            while not self.stopping.is_set():
                self.serve_once(POLL_MS)
        finally:
            logger.info(
                "FFN daemon stopping: %d grouped expert computations, %d requests batched with another's",
                self.layers_computed,
                self.requests_batched,
            )
            self.socket.close()
            self.context.term()

    def serve_once(self, timeout_ms: int) -> int:
        """Take what has arrived (waiting up to `timeout_ms` for a first message, then up
        to `batch_window_s` for more) and answer it all; how many messages."""
        if not self.socket.poll(timeout_ms):
            return 0
        arrived = [self.socket.recv_multipart()]
        deadline = time.monotonic() + self.batch_window_s
        while len(arrived) < self.max_batch_messages and self.socket.poll(
            max(0, int((deadline - time.monotonic()) * 1000))
        ):
            arrived.append(self.socket.recv_multipart())
        work = [item for identity, *frames in arrived if (item := self.admit(identity, frames)) is not None]
        by_layer: dict[int, list[LayerWork]] = defaultdict(list)
        for item in work:
            by_layer[item.request.layer].append(item)
        for layer, items in by_layer.items():
            self.compute_layer(layer, items)
        return len(arrived)

    def stop(self) -> None:
        self.stopping.set()

    def admit(self, identity: bytes, frames: list[bytes]) -> LayerWork | None:
        """A checked MOE request to compute; anything else (HELLO, a refusal, an error)
        is answered here."""
        if frames == [PING]:  # from this loop, so a stopped or wedged daemon does not answer
            self.socket.send_multipart([identity, PONG])
            return None
        body = self.mac.open(frames)
        if body is None or (self.mac.enabled and len(body) < 3):
            self.refused += 1
            logger.warning("refused an FFN message that failed authentication")
            self.socket.send_multipart([identity, json.dumps({"ok": False, "error": UNAUTHORIZED}).encode()])
            return None
        stamp = b""
        if self.mac.enabled:
            stamp, body = body[-1], body[:-1]
        if len(body) < 2:
            logger.warning("dropped an FFN message without a header")
            return None
        kind, header_frame, data = body[0], body[1], body[2:]
        if self.mac.enabled and kind != HELLO and not self.sessions.admit(stamp):
            self.refused += 1
            logger.warning("dropped a replayed FFN message (or of a session this daemon did not issue)")
            return None
        try:
            header = json.loads(header_frame)
            if not isinstance(header, dict):
                raise AfdProtocolError("the header is not a JSON object")
            if kind == HELLO:
                answer = {"id": header.get("id"), "ok": True, **self.layout.to_header()}
                if self.mac.enabled:
                    answer["session"] = self.sessions.issue(identity).hex()
                if "shm" in header:
                    answer.update(self.map_segment(identity, header["shm"]))
                self.reply(identity, stamp, answer, [])
                return None
            if kind == MOE:
                request = MoeLayerRequest.from_header(header)
                return LayerWork(identity, stamp, request, *self.layer_tensors(identity, request, data))
            raise AfdProtocolError(f"unknown message kind {kind[:16]!r}")
        except (ValueError, KeyError, RuntimeError) as exc:
            error = {"id": _request_id(header_frame), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self.reply(identity, stamp, error, [])
            return None

    def reply(self, identity: bytes, stamp: bytes, answer: dict, data: list[bytes]) -> None:
        frames = [json.dumps(answer).encode(), *data]
        if self.mac.enabled:
            frames.append(stamp)  # binds the reply to the request it answers
        self.socket.send_multipart([identity, *self.mac.seal(frames)])

    def map_segment(self, identity: bytes, offer_header: object) -> dict:
        """The HELLO answer's `shm` (and why not): the offered segment mapped for this
        connection, in place of any it had."""
        self.segments.pop(identity, None)
        for gone in [i for i, segment in self.segments.items() if not segment.still_owned()]:
            del self.segments[gone]  # their engines closed them (a reconnect, or gone)
        try:
            offer = ShmOffer.from_header(offer_header)
            segment = map_engine_segment(offer, self.layout.hidden_size, self.layout.top_k, self.layout.dtype)
        except (AfdProtocolError, TransferError) as exc:
            logger.info("an engine's shared-memory segment not used: %s", exc)
            return {"shm": False, "shm_error": str(exc)}
        self.segments[identity] = segment
        while len(self.segments) > MAX_SEGMENTS:
            self.segments.popitem(last=False)
        return {"shm": True}

    def layer_tensors(
        self, identity: bytes, request: MoeLayerRequest, data: list[bytes]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The request's hidden states, expert ids and weights, and where its output goes
        in the engine's segment (None: a frame) (AfdProtocolError, or ValueError for a frame
        of the wrong size, when they are not what it says)."""
        if request.layer not in self.experts:
            raise AfdProtocolError(f"layer {request.layer} is not a sparse layer of this model")
        frames = 0 if request.slot is not None else 3
        if DTYPES[request.dtype] != self.dtype or request.top_k != self.layout.top_k or len(data) != frames:
            raise AfdProtocolError(
                f"expected {self.layout.dtype} hidden states, top-{self.layout.top_k} ids and weights"
            )
        tokens, hidden, top_k = request.num_tokens, self.layout.hidden_size, request.top_k
        out = None
        if request.slot is not None:
            segment = self.segments.get(identity)
            if segment is None:
                raise AfdProtocolError("a shared-memory slot named on a connection that offered no segment")
            x, ids, weights, out = segment.views(request.slot, tokens)
            ids = ids.long()  # a copy: checked below, whatever the engine writes meanwhile
        else:
            x = tensor_from_frame(data[0], self.dtype, (tokens, hidden))
            ids = tensor_from_frame(data[1], torch.int32, (tokens, top_k)).long()
            weights = tensor_from_frame(data[2], self.dtype, (tokens, top_k))
        if tokens and (int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_experts):
            raise AfdProtocolError(f"expert ids must be in 0..{self.layout.num_experts - 1}")
        return x, ids, weights, out

    @torch.inference_mode()
    def compute_layer(self, layer: int, items: list[LayerWork]) -> None:
        """The requests of `layer`, each answered with its rows: one grouped expert
        computation each, or with `combine_engines` one for all of them; `compute_s` is
        what the request waited for (the batch's, combined)."""
        if len(items) > 1 and not self.combine_engines:
            for item in items:
                self.compute_layer(layer, [item])
            return
        started = time.perf_counter()
        if len(items) == 1:
            outputs = [self.experts[layer](items[0].x, items[0].ids, items[0].weights)]
        else:
            combined = self.experts[layer](
                torch.cat([i.x for i in items]),
                torch.cat([i.ids for i in items]),
                torch.cat([i.weights for i in items]),
            )
            outputs = list(combined.split([i.request.num_tokens for i in items]))
            self.requests_batched += len(items)
        self.layers_computed += 1
        compute_s = time.perf_counter() - started  # the rest of a round trip is exposed
        for item, output in zip(items, outputs, strict=True):
            request = item.request
            answer = {
                "id": request.id,
                "ok": True,
                "layer": layer,
                "num_tokens": request.num_tokens,
                "compute_s": compute_s,
            }
            if item.out is not None:
                item.out.copy_(output)
                self.reply(item.identity, item.stamp, answer, [])
            else:
                self.reply(item.identity, item.stamp, answer, [tensor_frame(output)])


def _request_id(header_frame: bytes) -> object:
    try:
        header = json.loads(header_frame)
    except ValueError:
        return None
    return header.get("id") if isinstance(header, dict) else None


def run_ffn(args: argparse.Namespace, model_path: str) -> int:
    """The CLI's `--role ffn`: load the experts, serve until SIGINT or SIGTERM."""
    from splitserve.engine.device import choose_dtype, default_device
    from splitserve.model.loader import load_decoder_config
    from splitserve.model.moe import load_experts
    from splitserve.runtime import access

    try:
        access.internal_policy(args)  # refuses a non-loopback --host without a token
        config = load_decoder_config(model_path)
        device = torch.device(args.device) if args.device else default_device()
        dtype = choose_dtype(None if args.dtype == "auto" else args.dtype, config.dtype, device)
        experts = load_experts(model_path, config, dtype, device)
        server = FfnServer(
            experts,
            config,
            dtype,
            args.host,
            args.port,
            access.internal_token(),
            combine_engines=args.ffn_combine_engines,
        )
    except (OSError, ValueError, zmq.ZMQError) as exc:
        raise SystemExit(f"splitserve engine --role ffn: {exc}") from exc
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: server.stop())
    logger.info(
        "FFN daemon: %d sparse layers of %s (%s) on tcp://%s:%d",
        len(experts),
        model_path,
        dtype_name(dtype),
        args.host,
        server.port,
    )
    server.serve_forever()
    return 0
