"""Cross-host KV transport: a layer's blocks travel as one ZeroMQ data frame.

The receiver's socket thread writes each frame into its pool and counts the arrival. Pull
asks the source to push every layer back, then the source releases its blocks.
"""

from __future__ import annotations

import warnings

import torch
import zmq

from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.block_copy import copy_blocks, gather_blocks
from splitserve.kv.transport.send_lane import LaneSocket
from splitserve.kv.transport.types import CallbackJob, PeerInfo, PullJob, PushJob, TransferError


class TcpTransport(KVTransport):
    name = "tcp"

    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=device)
        return self.pool

    def _send_push(self, socket: LaneSocket, job: PushJob) -> int:
        assert self.pool is not None
        with socket.writing():  # after this the frame owns a copy: the blocks may be freed
            data = gather_blocks(self.pool[job.layer], job.src_block_ids).cpu()
        payload = data.view(torch.uint8).numpy()
        header = {
            "transfer_id": job.transfer_id,
            "layer": job.layer,
            "dst": job.dst_block_ids,
            "ready_at": job.ready_at,
            "hashes": job.block_hashes,
        }
        self.control.send(socket, b"PUSH", header, memoryview(payload.reshape(-1)))
        return payload.nbytes

    def _on_push(self, header: dict, frames: list[zmq.Frame]) -> int:
        assert self.pool is not None
        if not frames:
            raise TransferError("a tcp KV push arrived without data")
        layer_pool = self.pool[header["layer"]]
        shape = (layer_pool.shape[0], len(header["dst"]), *layer_pool.shape[2:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # zmq frames are read-only; we copy at once
            raw = torch.frombuffer(frames[0].buffer, dtype=torch.uint8)
        data = raw.view(self.pool.dtype).view(shape)
        copy_blocks(layer_pool, header["dst"], data.to(self.pool.device), list(range(len(header["dst"]))))
        return raw.numel()

    def _do_pull(self, socket: LaneSocket, job: PullJob) -> None:
        me = self.peer_info()
        header = {
            "transfer_id": job.transfer_id,
            "src": job.src_block_ids,
            "dst": job.dst_block_ids,
            "hashes": job.block_hashes,
            "reply_to": list(me),
        }
        self.control.send(socket, b"PULL", header)

    def _on_pull_request(self, header: dict) -> None:
        peer = PeerInfo(*header["reply_to"])
        transfer_id, hashes = header["transfer_id"], list(header.get("hashes", []))
        if self.is_held is not None and not self.is_held(transfer_id, list(header["src"]), hashes):
            error = f"engine {self.engine_id} no longer holds the blocks (or not of these tokens)"
            self.send_failure(peer, transfer_id, error)
            return
        assert self.pool is not None
        for layer in range(self.pool.shape[0]):
            self.push_layer(peer, transfer_id, layer, header["src"], header["dst"], None, hashes)
        release = self.on_release
        if release is not None:
            self._enqueue(peer, CallbackJob(peer, transfer_id, lambda: release(transfer_id)))
