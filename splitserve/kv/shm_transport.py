"""Same-host KV transport: pools live in shared-memory files, peers write into them directly.

The sender maps the receiver's pool (learned at connection set-up) and copies a layer's
blocks into it, a one-sided write like RDMA; only a small notification frame crosses the
socket. Pull maps the source's pool and reads from it, then tells the source to release.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import warnings

import torch
import zmq

from splitserve.kv.block_copy import copy_blocks
from splitserve.kv.transport import KVTransport
from splitserve.kv.transport_types import (
    PeerInfo,
    PoolLayout,
    PullJob,
    PushJob,
    TransferError,
    dtype_from_name,
)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_pool(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor backed by the shared file at `path` (created and sized when missing). The
    mapping is populated up front, so no transfer pays page faults on first touch."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=dtype).view(shape)


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._path: str | None = None
        self._fd: int | None = None
        self._peer_pools: dict[str, torch.Tensor] = {}

    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        if str(device) != "cpu":
            raise TransferError("the shm transport keeps KV pools in host memory; use device cpu")
        path = os.path.join(_shm_dir(), f"splitserve-kv-{os.getpid()}-{self.engine_id}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.pool = map_pool(path, tuple(shape), dtype)
        # Unlinked at once and reached through our open descriptor: the memory goes away
        # with this process, however it dies.
        self._fd = os.open(path, os.O_RDWR)
        os.unlink(path)
        self._path = f"/proc/{os.getpid()}/fd/{self._fd}"
        return self.pool

    def _shm_path(self) -> str | None:
        return self._path

    def _release_pool(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._path = None
        self._peer_pools.clear()

    def _on_handshake(self, peer: PeerInfo, layout: PoolLayout) -> None:
        if not layout.shm_path or not os.path.exists(layout.shm_path):
            raise TransferError(f"KV peer {peer.engine_id} has no shared-memory pool on this host")
        self._peer_pools[f"{peer.host}:{peer.port}"] = map_pool(
            layout.shm_path, layout.shape, dtype_from_name(layout.dtype)
        )

    def _send_push(self, socket: zmq.Socket, job: PushJob) -> int:
        assert self.pool is not None
        target = self._peer_pools[f"{job.peer.host}:{job.peer.port}"]
        num_bytes = copy_blocks(target[job.layer], job.dst_block_ids, self.pool[job.layer], job.src_block_ids)
        header = {
            "transfer_id": job.transfer_id,
            "layer": job.layer,
            "dst": job.dst_block_ids,
            "ready_at": job.ready_at,
            "bytes": num_bytes,
        }
        self._send_control(socket, b"PUSH", header)
        return num_bytes

    def _on_push(self, header: dict, frames: list[zmq.Frame]) -> int:
        return int(header.get("bytes", 0))  # the sender already wrote into our pool

    def _do_pull(self, socket: zmq.Socket, job: PullJob) -> None:
        assert self.pool is not None
        source = self._peer_pools[f"{job.peer.host}:{job.peer.port}"]
        # Held before and after the read means held throughout: the blocks were not reused.
        if not self._ask_held(socket, job.transfer_id):
            raise TransferError(f"engine {job.peer.engine_id} no longer holds the blocks")
        for layer in range(self.pool.shape[0]):
            num_bytes = copy_blocks(self.pool[layer], job.dst_block_ids, source[layer], job.src_block_ids)
            if layer == self.pool.shape[0] - 1 and not self._ask_held(socket, job.transfer_id):
                raise TransferError(f"engine {job.peer.engine_id} released the blocks during the read")
            self.record_arrival(job.transfer_id, layer, job.dst_block_ids, num_bytes, None)
        self._send_control(socket, b"RELEASE", {"transfer_id": job.transfer_id})
