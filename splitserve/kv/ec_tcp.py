"""The encoder cache across hosts: an `ECServer` serves a host's encoder cache by image
hash over ZeroMQ (the messaging the KV transport uses), and `TcpECConnector` is the
connector a prefill/decode engine (or an encoder worker) on another host uses to reach it.

One request, one reply, each a JSON header frame plus, for embeddings, one raw data frame:
  {"op": "has" | "get" | "put", "id": n, "nonce": hex, "hash": hex, ["dtype", "shape"]}
  -> {"id": n, "nonce": hex, "ok": bool, "found": bool, ["dtype", "shape"], ["error"]}
The server binds to loopback unless told otherwise; with a token (the deployment's internal
token: engines pass `protocol.access.internal_token()`) every message carries a keyed MAC
derived from it (`kv/transport/frame_mac.py`, its own label), the token itself never crosses the
wire, the server refuses a request without a valid MAC (an untagged "unauthorized"), and
a client takes only a reply with a valid MAC that echoes its request's random nonce. A client that gets
no answer within its timeout reports a miss, so the engine falls back to its own encoder
(slower, never lost).
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading

import torch
import zmq

from splitserve.encoder_cache.connector import ECConnector, check_image_hash
from splitserve.kv.transport.frame_mac import FrameMac

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_POLL_MS = 50
_MAC_LABEL = b"splitserve encoder cache v1"


def _tensor_frames(embeddings: torch.Tensor) -> tuple[dict, bytes]:
    tensor = embeddings.detach().contiguous().cpu()
    meta = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return meta, tensor.view(torch.uint8).numpy().tobytes()


def _tensor_from(meta: dict, data: bytes, max_bytes: int) -> torch.Tensor:
    dtype, shape = _DTYPES[meta["dtype"]], [int(n) for n in meta["shape"]]
    if len(data) > max_bytes:
        raise ValueError(f"embeddings of {len(data)} bytes are over {max_bytes}")
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


def _request_ids(frames: list[bytes]) -> dict:
    """The id and nonce a request names, for its answer (empty when unreadable)."""
    try:
        header = json.loads(frames[0])
        return {"id": header.get("id"), "nonce": header.get("nonce")} if isinstance(header, dict) else {}
    except (ValueError, IndexError):
        return {}


class ECServer:
    """Serves `store` (e.g. this host's SharedMemoryECConnector) to other hosts."""

    def __init__(
        self,
        store: ECConnector,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_entry_bytes: int = 256 * 2**20,
    ) -> None:
        self.store = store
        self._mac = FrameMac(token, _MAC_LABEL)
        self.max_entry_bytes = max_entry_bytes
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_entry_bytes + 2**16)  # bigger: dropped unread
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="splitserve-ec-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._context.term()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            identity, *frames = self._socket.recv_multipart()
            body = self._mac.open(frames)
            if body is None:  # refused at once, untagged: no answer carries our MAC to it
                refusal = {**_request_ids(frames), "ok": False, "found": False, "error": "unauthorized"}
                self._socket.send_multipart([identity, json.dumps(refusal).encode()])
                continue
            reply, data = self._answer(body)
            answer = self._mac.seal([json.dumps(reply).encode(), *([data] if data else [])])
            self._socket.send_multipart([identity, *answer])

    def _answer(self, frames: list[bytes]) -> tuple[dict, bytes | None]:
        reply: dict = {"id": None, "ok": True, "found": False}
        try:
            reply |= _request_ids(frames)
            header = json.loads(frames[0])
            image_hash = header["hash"]
            check_image_hash(image_hash)
            if header["op"] == "has":
                return {**reply, "found": self.store.has_cache(image_hash)}, None
            if header["op"] == "get":
                embeddings = self.store.load_cache(image_hash, torch.device("cpu"))
                if embeddings is None:
                    return reply, None
                meta, data = _tensor_frames(embeddings)
                return {**reply, "found": True, **meta}, data
            if header["op"] == "put":
                self.store.save_cache(image_hash, _tensor_from(header, frames[1], self.max_entry_bytes))
                return {**reply, "found": True}, None
            return {**reply, "ok": False, "error": f"unknown op {header['op']!r}"}, None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RuntimeError, OSError) as exc:
            return {**reply, "ok": False, "error": f"{type(exc).__name__}: {exc}"}, None


class TcpECConnector(ECConnector):
    """Both halves against a remote ECServer. Thread-safe (one request at a time)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None = None,
        timeout_s: float = 5.0,
        max_entry_bytes: int = 256 * 2**20,
    ) -> None:
        self.address = f"tcp://{host}:{port}"
        self._mac = FrameMac(token, _MAC_LABEL)
        self.timeout_ms = int(timeout_s * 1000)
        self.max_entry_bytes = max_entry_bytes
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        return socket

    def _request(self, header: dict, data: bytes | None = None) -> tuple[dict, bytes | None] | None:
        """The reply, or None when the server does not answer in time (or refuses)."""
        with self._lock:
            request_id, nonce = next(self._ids), secrets.token_hex(16)
            header = {**header, "id": request_id, "nonce": nonce}
            frames = [json.dumps(header).encode(), *([data] if data is not None else [])]
            self._socket.send_multipart(self._mac.seal(frames))
            while self._socket.poll(self.timeout_ms):
                reply_frames = self._mac.open(self._socket.recv_multipart())
                if reply_frames is None:  # the server refused us (another token), or a forgery
                    logger.warning("encoder cache server %s: a reply failed authentication", self.address)
                    return None
                reply = json.loads(reply_frames[0])
                if reply.get("id") != request_id or reply.get("nonce") != nonce:
                    continue  # the late answer to a request that timed out, or a replayed one
                if not reply.get("ok"):
                    logger.warning("encoder cache server refused %s: %s", header["op"], reply.get("error"))
                    return None
                return reply, reply_frames[1] if len(reply_frames) > 1 else None
            logger.warning("encoder cache server %s did not answer in time", self.address)
            self._socket.close()  # drop what may still arrive for this request
            self._socket = self._connect()
            return None

    def has_cache(self, image_hash: str) -> bool:
        check_image_hash(image_hash)
        answer = self._request({"op": "has", "hash": image_hash})
        return answer is not None and bool(answer[0]["found"])

    def load_cache(self, image_hash: str, device: torch.device) -> torch.Tensor | None:
        check_image_hash(image_hash)
        answer = self._request({"op": "get", "hash": image_hash})
        if answer is None or not answer[0]["found"] or answer[1] is None:
            return None
        try:
            return _tensor_from(answer[0], answer[1], self.max_entry_bytes).to(device)
        except (ValueError, KeyError, RuntimeError) as exc:
            logger.warning(
                "encoder cache entry %s from %s is unreadable: %s", image_hash[:16], self.address, exc
            )
            return None

    def save_cache(self, image_hash: str, embeddings: torch.Tensor) -> None:
        check_image_hash(image_hash)
        meta, data = _tensor_frames(embeddings)
        if self._request({"op": "put", "hash": image_hash, **meta}, data) is None:
            raise OSError(f"encoder cache server {self.address} did not store {image_hash[:16]}")

    def shutdown(self) -> None:
        with self._lock:
            self._socket.close()
        self._context.term()
