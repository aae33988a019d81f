"""KV transport chosen per peer: shm with a peer on the same node, tcp with any other.

A deployment whose engines move between nodes (a Ray Serve replica is placed wherever it
fits) cannot name one transport for all of them. This one keeps its pool in a
shared-memory file (a CPU pool; on a GPU it is plain tcp) and decides at each lane's
handshake: a peer that reports the same node ID and a shared-memory pool is written into
directly, as `ShmTransport` does; any other peer gets the blocks as data frames, as
`TcpTransport` does. A same-node peer whose pool cannot be mapped (another container,
another user) falls back to tcp. The receiver tells the two apart by the frame: a push
with data came over tcp, one without was written into its pool already.
"""

from __future__ import annotations

import logging

import torch
import zmq

from splitserve.kv.transport.send_lane import LaneSocket
from splitserve.kv.transport.shm import ShmTransport, map_peer_pool
from splitserve.kv.transport.tcp import TcpTransport
from splitserve.kv.transport.types import (
    PeerInfo,
    PoolLayout,
    PullJob,
    PushJob,
    TransferError,
    dtype_from_name,
)

logger = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_node_id() -> str | None:
    """This machine's identity when no node ID is given: its boot ID (one per running
    kernel), or None where there is none (then any peer with a mappable pool is local)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as boot_id:
            return boot_id.read().strip() or None
    except OSError:
        return None


class AutoTransport(ShmTransport, TcpTransport):
    name = "auto"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.node_id = self.config.node_id or host_node_id()
        self.received_bytes = {"shm": 0, "tcp": 0}
        self.shm_pulls: set[str] = set()  # transfers this engine is reading from a peer's pool

    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        if str(device) != "cpu":  # a GPU pool has no shared-memory file: every peer gets tcp
            return TcpTransport.allocate_pool(self, shape, dtype, device)
        return ShmTransport.allocate_pool(self, shape, dtype, device)

    def layout(self) -> PoolLayout:
        return super().layout()._replace(node_id=self.node_id)

    def received_by_path(self) -> dict[str, int]:
        with self._lock:
            return dict(self.received_bytes)

    def _count_received(self, path: str, num_bytes: int) -> None:
        with self._lock:  # the receiver thread (pushes) and the lanes (shm pulls) both count
            self.received_bytes[path] += num_bytes

    def _on_handshake(self, peer: PeerInfo, layout: PoolLayout) -> torch.Tensor | None:
        """The peer's pool mapped here when it sits on this node (shm), else None (tcp)."""
        mine = self.layout()
        same_node = layout.node_id is None or mine.node_id is None or layout.node_id == mine.node_id
        if not same_node or layout.shm_pid is None or layout.shm_fd is None or mine.shm_fd is None:
            return None
        try:
            return map_peer_pool(
                peer.engine_id, layout.shm_pid, layout.shm_fd, layout.shape, dtype_from_name(layout.dtype)
            )
        except TransferError as exc:
            logger.info("KV peer %s: no shared memory with it (%s); using tcp", peer.engine_id, exc)
            return None

    def _send_push(self, socket: LaneSocket, job: PushJob) -> int:
        if socket.peer_pool is not None:
            return ShmTransport._send_push(self, socket, job)
        return TcpTransport._send_push(self, socket, job)

    def _on_push(self, header: dict, frames: list[zmq.Frame]) -> int:
        if frames:
            num_bytes = TcpTransport._on_push(self, header, frames)
            self._count_received("tcp", num_bytes)
        else:
            num_bytes = ShmTransport._on_push(self, header, frames)
            self._count_received("shm", num_bytes)
        return num_bytes

    def _do_pull(self, socket: LaneSocket, job: PullJob) -> None:
        if socket.peer_pool is None:
            TcpTransport._do_pull(self, socket, job)
            return
        self.shm_pulls.add(job.transfer_id)  # its arrivals are counted as they are recorded
        try:
            ShmTransport._do_pull(self, socket, job)
        finally:
            self.shm_pulls.discard(job.transfer_id)

    def record_arrival(
        self, transfer_id: str, layer: int, block_ids: list[int], num_bytes: int, ready_at: float | None
    ) -> None:
        if transfer_id in self.shm_pulls:
            self._count_received("shm", num_bytes)
        super().record_arrival(transfer_id, layer, block_ids, num_bytes, ready_at)

    def _on_pull_request(self, header: dict) -> None:
        TcpTransport._on_pull_request(self, header)
