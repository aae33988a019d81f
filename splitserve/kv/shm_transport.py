"""Same-host KV transport: pools live in shared-memory files, peers write into them directly.

The sender maps the receiver's pool (learned at connection set-up) and copies a layer's
blocks into it, a one-sided write like RDMA; only a small notification frame crosses the
socket. Pull maps the source's pool and reads from it, then tells the source to release.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import stat
import tempfile
import warnings

import torch
import zmq

from splitserve.kv.transport.block_copy import copy_blocks
from splitserve.kv.transport.send_lane import LaneSocket
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.types import (
    PeerInfo,
    PoolLayout,
    PullJob,
    PushJob,
    TransferError,
    dtype_from_name,
)
from splitserve.runtime.process_lifetime import process_alive

logger = logging.getLogger(__name__)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_SEGMENT_PREFIX = "splitserve-kv-"
_ENGINE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SEGMENT_NAME = re.compile(rf"{_SEGMENT_PREFIX}([0-9]{{1,10}})-{_ENGINE_ID.pattern}")


def segment_path(pid: int, engine_id: str) -> str:
    """Where engine `engine_id` of process `pid` creates its pool: the only name a worker
    maps, derived from the peer's identity, never taken from a message."""
    if not _ENGINE_ID.fullmatch(engine_id):
        raise TransferError(f"KV engine ID {engine_id!r} is not a plain name")
    return os.path.join(_shm_dir(), f"{_SEGMENT_PREFIX}{pid}-{engine_id}")


def _pool_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _map_fd(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the file open at `fd`, populated up front, so no transfer pays page
    faults on first touch."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(fd, _pool_bytes(shape, dtype), flags=flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=dtype).view(shape)


def create_pool(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """This engine's own pool: a new file at `path` (never an existing one), unlinked as
    soon as it is open, so the memory goes away with this process however it dies; peers
    reach it through the returned descriptor. Returns (descriptor, pool)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.unlink(path)  # before sizing and populating, which take long for a large pool
    try:
        os.ftruncate(fd, _pool_bytes(shape, dtype))
        return fd, _map_fd(fd, shape, dtype)
    except BaseException:
        os.close(fd)
        raise


def remove_stale_segments() -> list[str]:
    """Remove the segments of this user whose creating process is gone; returns their paths.
    A pool is unlinked right after it is created, so only a process killed in between leaves
    one behind, and nobody can map it any more: a peer reaches a pool only through its
    owner's live /proc/PID/fd. A PID in use again (alive) keeps its segment."""
    directory, removed = _shm_dir(), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _SEGMENT_NAME.fullmatch(name)
        if match is None or process_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(path)
    return removed


def map_peer_pool(engine_id: str, pid: int, fd: int, shape: tuple[int, ...], dtype: torch.dtype):
    """A peer's pool, reached through its open descriptor, mapped only when it is the
    unlinked segment `segment_path(pid, engine_id)`, a regular file of our own user of
    exactly the pool's size: nothing is created, extended or followed elsewhere."""
    expected = f"{segment_path(pid, engine_id)} (deleted)"
    try:
        own_fd = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDWR)
    except OSError as exc:
        raise TransferError(f"KV peer {engine_id} has no shared-memory pool on this host") from exc
    try:
        # What we actually opened, not what a message said: race-free.
        opened = os.readlink(f"/proc/self/fd/{own_fd}")
        info = os.fstat(own_fd)
        if (
            opened != expected
            or not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_size != _pool_bytes(shape, dtype)
        ):
            raise TransferError(f"KV peer {engine_id} offered a segment that is not its KV pool")
        return _map_fd(own_fd, shape, dtype)
    finally:
        os.close(own_fd)


def pool_still_owned(engine_id: str, pid: int, fd: int) -> bool:
    """Whether the peer that offered its pool as (pid, fd) still holds it: its descriptor
    still leads to the segment its engine ID names. Once the peer is gone (killed too),
    a peer's mapping is what keeps the pool's memory alive. A PID in use again cannot
    pass: the segment's name holds the engine's own ID."""
    try:
        return os.readlink(f"/proc/{int(pid)}/fd/{int(fd)}") == f"{segment_path(pid, engine_id)} (deleted)"
    except OSError:
        return False


class ShmTransport(KVTransport):
    name = "shm"
    stops_at_once = False  # a peer writes into our pool itself: we cannot stop it mid-copy

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fd: int | None = None

    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        if str(device) != "cpu":
            raise TransferError("the shm transport keeps KV pools in host memory; use device cpu")
        for path in remove_stale_segments():
            logger.info("removed a KV segment its dead creator left behind: %s", path)
        self._fd, self.pool = create_pool(segment_path(os.getpid(), self.engine_id), tuple(shape), dtype)
        return self.pool

    def _shm_handle(self) -> tuple[int | None, int | None]:
        return (os.getpid(), self._fd) if self._fd is not None else (None, None)

    def _release_pool(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _on_handshake(self, peer: PeerInfo, layout: PoolLayout) -> torch.Tensor:
        if layout.shm_pid is None or layout.shm_fd is None:
            raise TransferError(f"KV peer {peer.engine_id} has no shared-memory pool on this host")
        # Held by the lane alone: when it ends (stalled, idle, closed) the mapping goes, so
        # a dead peer's pool is not kept alive by its peers.
        return map_peer_pool(
            peer.engine_id, layout.shm_pid, layout.shm_fd, layout.shape, dtype_from_name(layout.dtype)
        )

    def peer_gone(self, socket: LaneSocket) -> bool:
        layout = socket.peer_layout
        if socket.peer_pool is None or layout is None or layout.shm_pid is None or layout.shm_fd is None:
            return False
        return not pool_still_owned(socket.lane.peer.engine_id, layout.shm_pid, layout.shm_fd)

    def _send_push(self, socket: LaneSocket, job: PushJob) -> int:
        assert self.pool is not None
        target = socket.peer_pool
        assert target is not None  # mapped at the lane's handshake
        with socket.writing():
            num_bytes = copy_blocks(
                target[job.layer], job.dst_block_ids, self.pool[job.layer], job.src_block_ids
            )
        header = {
            "transfer_id": job.transfer_id,
            "layer": job.layer,
            "dst": job.dst_block_ids,
            "ready_at": job.ready_at,
            "bytes": num_bytes,
            "hashes": job.block_hashes,
        }
        self.control.send(socket, b"PUSH", header)
        return num_bytes

    def _on_push(self, header: dict, frames: list[zmq.Frame]) -> int:
        return int(header.get("bytes", 0))  # the sender already wrote into our pool

    def _do_pull(self, socket: LaneSocket, job: PullJob) -> None:
        assert self.pool is not None
        source = socket.peer_pool
        assert source is not None  # mapped at the lane's handshake
        # Held before and after the read means held throughout: the blocks were not reused.
        if not self._ask_held(socket, job):
            raise TransferError(
                f"engine {job.peer.engine_id} no longer holds the blocks (or not of these tokens)"
            )
        for layer in range(self.pool.shape[0]):
            with socket.writing():  # never into blocks a failed pull gave back for recompute
                num_bytes = copy_blocks(self.pool[layer], job.dst_block_ids, source[layer], job.src_block_ids)
            last = layer == self.pool.shape[0] - 1
            if last and not self._ask_held(socket, job):
                raise TransferError(f"engine {job.peer.engine_id} released the blocks during the read")
            self.record_arrival(job.transfer_id, layer, job.dst_block_ids, num_bytes, None)
        self.control.send(socket, b"RELEASE", {"transfer_id": job.transfer_id})
