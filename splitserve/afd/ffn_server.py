"""`splitserve engine MODEL --role ffn`: the FFN daemon of attention-FFN disaggregation.

It holds only a MoE model's experts (no attention, no scheduler, no KV cache) and answers
one message per sparse layer of every forward pass of its attention engine: the layer's
post-attention hidden states and the router's top-k ids and weights in, the combined
expert output out (protocol/afd.py). One ZeroMQ ROUTER socket, one thread: messages are
computed in arrival order.

Authentication reuses the KV transport's pieces (kv/transport/frame_mac.py): every
message is sealed with a MAC derived from the deployment's internal token under the AFD
label; HELLO gets a session, and each later message of that session must carry a higher
sequence number (ReplayGuard), so a captured message sent again is dropped. A message
that fails the MAC is answered untagged {"ok": false, "error": "unauthorized"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time

import torch
import zmq

from splitserve.afd.wire import DTYPES, afd_mac, dtype_name, tensor_frame, tensor_from_frame
from splitserve.kv.transport.frame_mac import ReplayGuard
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.moe import Experts
from splitserve.protocol.afd import HELLO, MOE, UNAUTHORIZED, AfdProtocolError, FfnLayout, MoeLayerRequest

logger = logging.getLogger(__name__)

POLL_MS = 100
MAX_MESSAGE_BYTES = 1 << 30


class FfnServer:
    def __init__(
        self,
        experts: dict[int, Experts],  # by layer index
        config: DecoderConfig,
        dtype: torch.dtype,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
    ) -> None:
        assert config.moe is not None
        self.experts, self.dtype = experts, dtype
        self.layout = FfnLayout(
            config.hidden_size,
            config.moe.num_experts,
            config.moe.top_k,
            tuple(sorted(experts)),
            dtype_name(dtype),
        )
        self.mac = afd_mac(token)
        self.sessions = ReplayGuard()
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
        self.layers_computed = 0
        self.refused = 0

    def serve_forever(self) -> None:
        """Answer messages until stop() (or SIGINT/SIGTERM in the CLI)."""
        try:
            while not self.stopping.is_set():
                if self.socket.poll(POLL_MS):
                    identity, *frames = self.socket.recv_multipart()
                    self.handle(identity, frames)
        finally:
            self.socket.close()
            self.context.term()

    def stop(self) -> None:
        self.stopping.set()

    def handle(self, identity: bytes, frames: list[bytes]) -> None:
        body = self.mac.open(frames)
        if body is None or (self.mac.enabled and len(body) < 3):
            self.refused += 1
            logger.warning("refused an FFN message that failed authentication")
            self.socket.send_multipart([identity, json.dumps({"ok": False, "error": UNAUTHORIZED}).encode()])
            return
        stamp = b""
        if self.mac.enabled:
            stamp, body = body[-1], body[:-1]
        if len(body) < 2:
            logger.warning("dropped an FFN message without a header")
            return
        kind, header_frame, data = body[0], body[1], body[2:]
        if self.mac.enabled and kind != HELLO and not self.sessions.admit(stamp):
            self.refused += 1
            logger.warning("dropped a replayed FFN message (or of a session this daemon did not issue)")
            return
        answer: dict
        out: list[bytes] = []
        try:
            header = json.loads(header_frame)
            if not isinstance(header, dict):
                raise AfdProtocolError("the header is not a JSON object")
            if kind == HELLO:
                answer = {"id": header.get("id"), "ok": True, **self.layout.to_header()}
                if self.mac.enabled:
                    answer["session"] = self.sessions.issue(identity).hex()
            elif kind == MOE:
                request = MoeLayerRequest.from_header(header)
                started = time.perf_counter()
                combined = self.compute(request, data)
                answer = {
                    "id": request.id,
                    "ok": True,
                    "layer": request.layer,
                    "num_tokens": request.num_tokens,
                    "compute_s": time.perf_counter() - started,  # the rest of a round trip is exposed
                }
                out = [tensor_frame(combined)]
            else:
                raise AfdProtocolError(f"unknown message kind {kind[:16]!r}")
        except (ValueError, KeyError, RuntimeError) as exc:
            answer, out = (
                {"id": _request_id(header_frame), "ok": False, "error": f"{type(exc).__name__}: {exc}"},
                [],
            )
        reply = [json.dumps(answer).encode(), *out]
        if self.mac.enabled:
            reply.append(stamp)  # binds the reply to the request it answers
        self.socket.send_multipart([identity, *self.mac.seal(reply)])

    @torch.inference_mode()
    def compute(self, request: MoeLayerRequest, data: list[bytes]) -> torch.Tensor:
        experts = self.experts.get(request.layer)
        if experts is None:
            raise AfdProtocolError(f"layer {request.layer} is not a sparse layer of this model")
        if DTYPES[request.dtype] != self.dtype or request.top_k != self.layout.top_k or len(data) != 3:
            raise AfdProtocolError(
                f"expected {self.layout.dtype} hidden states, top-{self.layout.top_k} ids and weights"
            )
        tokens, hidden, top_k = request.num_tokens, self.layout.hidden_size, request.top_k
        x = tensor_from_frame(data[0], self.dtype, (tokens, hidden))
        ids = tensor_from_frame(data[1], torch.int32, (tokens, top_k)).long()
        weights = tensor_from_frame(data[2], self.dtype, (tokens, top_k))
        if tokens and (int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_experts):
            raise AfdProtocolError(f"expert ids must be in 0..{self.layout.num_experts - 1}")
        self.layers_computed += 1
        return experts(x, ids, weights)


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
        server = FfnServer(experts, config, dtype, args.host, args.port, access.internal_token())
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
