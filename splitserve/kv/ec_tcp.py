"""The encoder cache across hosts: an `ECServer` serves a host's encoder cache by image
hash over ZeroMQ (the messaging the KV transport uses), and `TcpECConnector` is the
connector a prefill/decode engine (or an encoder worker) on another host uses to reach it.

One request, one reply, each a JSON header frame plus, for embeddings, one raw data frame:
  {"op": "has" | "get" | "put", "id": n, "hash": hex, "token": str, ["dtype", "shape"]}
  -> {"id": n, "ok": bool, "found": bool, ["dtype", "shape"], ["error"]}
The server binds to loopback unless told otherwise; with a token (the deployment's internal
token) it answers only requests carrying it. A client that gets no answer within its
timeout reports a miss, so the engine falls back to its own encoder (slower, never lost).
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import threading

import torch
import zmq

from splitserve.kv.ec_connector import ECConnector, check_image_hash

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_POLL_MS = 50


def _tensor_frames(embeddings: torch.Tensor) -> tuple[dict, bytes]:
    tensor = embeddings.detach().contiguous().cpu()
    meta = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return meta, tensor.view(torch.uint8).numpy().tobytes()


def _tensor_from(meta: dict, data: bytes, max_bytes: int) -> torch.Tensor:
    dtype, shape = _DTYPES[meta["dtype"]], [int(n) for n in meta["shape"]]
    if len(data) > max_bytes:
        raise ValueError(f"embeddings of {len(data)} bytes are over {max_bytes}")
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


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
        self.token = token
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
            reply, data = self._answer(frames)
            self._socket.send_multipart([identity, json.dumps(reply).encode(), *([data] if data else [])])

    def _answer(self, frames: list[bytes]) -> tuple[dict, bytes | None]:
        reply: dict = {"id": None, "ok": True, "found": False}
        try:
            header = json.loads(frames[0])
            reply["id"] = header.get("id")
            if self.token is not None and not hmac.compare_digest(str(header.get("token", "")), self.token):
                return {**reply, "ok": False, "error": "unauthorized"}, None
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
        self.token = token
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
            request_id = next(self._ids)
            header = {**header, "id": request_id, "token": self.token or ""}
            self._socket.send_multipart([json.dumps(header).encode(), *([data] if data is not None else [])])
            while self._socket.poll(self.timeout_ms):
                reply_frames = self._socket.recv_multipart()
                reply = json.loads(reply_frames[0])
                if reply.get("id") != request_id:
                    continue  # the late answer to a request that timed out
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
