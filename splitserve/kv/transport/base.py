"""KV transports: move blocks of one engine's paged KV pool into another engine's pool.

A pool is one contiguous tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`; block IDs index dim 2. Every transport has the same control plane: each engine
binds one ZeroMQ ROUTER socket (its address is the `PeerInfo` that travels in
`kv_transfer_params`), and each destination peer gets its own send lane: a queue, a thread
and a DEALER socket (send_lane.py), so a peer that stops answering delays only its own
transfers, and only until its lane is declared stalled. Transports differ only in the
data plane:

- `shm`: every pool lives in a shared-memory file; the sender writes a layer's blocks
  straight into the peer's pool (a one-sided write, like RDMA) and then sends a small
  notification frame.
- `tcp`: the layer's blocks travel as one ZeroMQ data frame; the receiver writes them.
- `nixl`: the pool is registered with a NIXL agent (UCX underneath); the sender writes a
  layer's blocks with one-sided NIXL WRITEs and the notification rides the WRITE (nixl.py).

A hybrid model's Mamba state travels whole, after the layers, as a STATE frame of the same
authenticated channel (shm and tcp alike). The receiver counts arrivals per transfer
(layers x blocks, + the state) and calls `on_done` once (arrivals.py). Pull asks the source
to send (`tcp`) or reads its pool (`shm`), then tells the source it may release the blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.kv.transport.arrivals import ArrivalTracker, TransferResult
from splitserve.kv.transport.control_channel import ControlChannel
from splitserve.kv.transport.send_lane import LaneSocket, SendLanes, job_transfer_id
from splitserve.kv.transport.send_stats import SendLedger
from splitserve.kv.transport.types import (
    ControlJob,
    PeerInfo,
    PoolLayout,
    PullJob,
    PushJob,
    StateJob,
    TransferError,
    dtype_name,
    layout_from_hello,
)
from splitserve.runtime.access import internal_token

__all__ = ["KVTransport"]

logger = logging.getLogger(__name__)

_POLL_MS = 20
# How long close() waits for the receiver and lane threads: each polls in 20 ms slices
# and gives up its socket call at once when closing, so only a copy in progress delays it.
_JOIN_TIMEOUT_S = 5.0


class KVTransport(ABC):
    """One per engine. Owns the pool allocation, the receiving socket and the send lanes."""

    name: str = ""
    # Can a transfer be stopped with the guarantee that none of its bytes land afterwards
    # (so its blocks may be reused at once)? tcp: yes, the receiver writes every byte
    # itself. shm: no, the sender writes one-sided into our pool.
    stops_at_once: bool = True

    def __init__(
        self,
        engine_id: str,
        config: TransferConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        max_queued_jobs: int = 64,
    ):
        self.engine_id = engine_id
        self.config = config
        self.host = host
        self._requested_port = port
        self.pool: torch.Tensor | None = None
        self._context = zmq.Context()
        self._router: zmq.Socket | None = None
        self.port = 0
        self.arrivals = ArrivalTracker(config.timeout_s, config.reservation_ttl_s)
        self._lock = threading.Lock()
        self._landing = threading.Lock()  # held while a push is checked and written into the pool
        self.max_queued_jobs = max(4, max_queued_jobs)
        socket_options = {zmq.LINGER: 0, zmq.SNDHWM: self.max_queued_jobs}
        bounds = (config.timeout_s, config.stalled_peer_s, config.handshake_timeout_s)
        self._lanes = SendLanes(self, self._context, socket_options, self.max_queued_jobs, *bounds)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.sent = SendLedger()
        self.on_release: Callable[[str], None] | None = None  # pull source: a peer has read the blocks
        # pull source: does this transfer still hold these blocks, with KV of these hashes?
        self.is_held: Callable[[str, list[int], list[str]], bool] | None = None
        self.state_bytes = 0  # a hybrid model's Mamba state of one request (0: none travels)
        self.control = ControlChannel(internal_token())  # MAC and replay stamps on every message

    # ---- pool ----------------------------------------------------------------------------
    @abstractmethod
    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        """Create this engine's KV pool where peers can reach it; the engine calls this."""

    def layout(self) -> PoolLayout:
        if self.pool is None:
            raise TransferError("the KV pool is not allocated yet")
        return PoolLayout(tuple(self.pool.shape), dtype_name(self.pool.dtype), *self._shm_handle())

    def _shm_handle(self) -> tuple[int | None, int | None]:
        """(pid, descriptor) of this engine's shared-memory pool, for the shm transport."""
        return None, None

    def received_by_path(self) -> dict[str, int]:
        return {}  # bytes received per data path ("shm", "tcp") where a transport uses both (auto)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> PeerInfo:
        if self._router is not None:
            return self.peer_info()
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, 0)
        if self._requested_port:
            router.bind(f"tcp://{self.host}:{self._requested_port}")
            self.port = self._requested_port
        else:
            self.port = router.bind_to_random_port(f"tcp://{self.host}")
        self._router = router
        thread = threading.Thread(target=self._receive_loop, name=f"kv-{self.name}-recv", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self.peer_info()

    def peer_info(self) -> PeerInfo:
        return PeerInfo(self.engine_id, self.host, self.port)

    def close(self) -> None:
        self._stop.set()
        # Each thread closes its own sockets on the way out; closing them from here while
        # a thread still uses one is what made libzmq abort at shutdown
        # ("Assertion failed: pfd.revents & POLLIN").
        lanes_exited = self._lanes.close(_JOIN_TIMEOUT_S)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [thread.name for thread in self._threads if thread.is_alive()]
        self._threads.clear()
        if alive or not lanes_exited:
            logger.warning("KV %s transport: threads still running at close; left to exit", self.name)
        else:
            self._context.destroy(linger=0)  # no thread uses a socket any more
        self._release_pool()

    def _release_pool(self) -> None:
        return None

    # ---- receiver API --------------------------------------------------------------------
    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        on_done: Callable[[TransferResult], None],
        ttl_s: float | None = None,
        block_hashes: Sequence[str] = (),
        state_hash: str = "",
    ) -> None:
        """Count arrivals for `block_ids` (every layer); `on_done` runs once, on any thread.
        With `block_hashes` (one per block) the transfer is bound to those tokens: data
        sent under other hashes is dropped. With `state_hash`, it also waits for the
        request's Mamba state (`state_bytes`, whole) bound to that hash."""
        if self.pool is None:
            raise TransferError("the KV pool is not allocated yet")
        state_bytes = self.state_bytes if state_hash else 0
        layers, blocks, hashes = self.pool.shape[0], list(block_ids), list(block_hashes)
        self.arrivals.expect(transfer_id, layers, blocks, on_done, ttl_s, hashes, state_bytes, state_hash)

    def cancel(self, transfer_id: str) -> None:
        """Stop expecting; later arrivals for it are ignored and `on_done` is not called."""
        self.arrivals.cancel(transfer_id)

    def fail(self, transfer_id: str, error: str) -> None:
        """Fail an expected transfer now (e.g. the proxy saw the prefill worker die)."""
        self.arrivals.finish(transfer_id, error)

    def stop(self, transfer_id: str, error: str) -> bool:
        """Fail a transfer whose request ended (its client left) so that its blocks can be
        reused now: True when nothing of it can land after this returns (`stops_at_once`);
        False, doing nothing, when the transport cannot promise that."""
        if not self.stops_at_once:
            return False
        with self._landing:  # a push being written finishes first; later ones are refused
            self.arrivals.finish(transfer_id, error)
        return True

    def pending_transfers(self) -> int:
        return self.arrivals.pending()

    def record_arrival(
        self, transfer_id: str, layer: int, block_ids: list[int], num_bytes: int, ready_at: float | None
    ) -> None:
        self.arrivals.record(transfer_id, layer, block_ids, num_bytes, ready_at)

    # ---- sender API ----------------------------------------------------------------------
    def may_dial(self, host: str, port: int) -> bool:
        """Is (host, port) a KV peer registered with the deployment (any, without a list)?"""
        allowed = self.config.allowed_peers
        return not allowed or (host, port) in allowed

    def push_layer(
        self,
        peer: PeerInfo,
        transfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        ready_at: float | None = None,
        block_hashes: Sequence[str] = (),
    ) -> None:
        """Queue one layer's blocks for the peer. Blocks (back-pressure) while the peer's lane
        is full; raises TransferError at once when the peer's lane is stalled, else once it is
        declared stalled (STALLED_PEER_S) or after `timeout_s`."""
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError("source and destination block lists differ in length")
        job = PushJob(
            peer,
            transfer_id,
            layer,
            list(src_block_ids),
            list(dst_block_ids),
            ready_at or time.time(),
            list(block_hashes),
        )
        self._enqueue(peer, job)

    def push_state(
        self, peer: PeerInfo, transfer_id: str, state: bytes, state_hash: str, ready_at: float
    ) -> None:
        """Queue a request's Mamba state for the peer: it goes after the layers queued
        before it, on the same lane, as one authenticated frame. Raises as `push_layer`."""
        self._enqueue(peer, StateJob(peer, transfer_id, state, state_hash, ready_at))

    def pull(
        self,
        peer: PeerInfo,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        block_hashes: Sequence[str] = (),
    ) -> None:
        """Fetch every layer of the peer's `src_block_ids` into our `dst_block_ids`; completion
        is reported to the expectation registered for `transfer_id` (a peer that is stalled
        fails it at once, never the caller). The source lends the blocks only if they hold
        KV of `block_hashes` (our prompt's, one per block)."""
        job = PullJob(peer, transfer_id, list(src_block_ids), list(dst_block_ids), list(block_hashes))
        try:
            self._enqueue(peer, job)
        except TransferError as exc:
            self.arrivals.finish(transfer_id, f"pull from {peer.engine_id} failed: {exc}")

    def send_failure(self, peer: PeerInfo, transfer_id: str, error: str) -> None:
        """Tell the receiver a transfer failed; a peer that cannot be reached learns it from
        its own timeout, so this never raises."""
        try:
            self._enqueue(peer, ControlJob(peer, b"FAIL", {"transfer_id": transfer_id, "error": error}))
        except TransferError as exc:
            logger.info("KV %s: could not report transfer %s failed: %s", self.name, transfer_id, exc)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every job queued on any lane is written (shm), handed to the socket
        (tcp) or failed with its stalled lane (a dead peer: STALLED_PEER_S at most)."""
        return not self.flush_peers(timeout_s)

    def flush_peers(self, timeout_s: float | None = None) -> set[PeerInfo]:
        """`flush`, answering the peers whose jobs were still queued at `timeout_s`."""
        return self._lanes.flush(self.config.timeout_s if timeout_s is None else timeout_s)

    def take_send_error(self, transfer_id: str) -> str | None:
        return self.sent.take_error(transfer_id)

    def _enqueue(self, peer: PeerInfo, job: object) -> None:
        """Queue a job for a peer's lane; a peer not registered is never dialled."""
        if not self.may_dial(peer.host, peer.port):
            raise TransferError(f"KV peer {peer.host}:{peer.port} is not registered with this deployment")
        self._lanes.put(peer, job)

    # ---- subclass hooks ------------------------------------------------------------------
    @abstractmethod
    def _send_push(self, socket: LaneSocket, job: PushJob) -> int:
        """Move one layer to the peer (touching pools only inside `socket.writing()`);
        returns the bytes moved."""

    @abstractmethod
    def _do_pull(self, socket: LaneSocket, job: PullJob) -> None:
        """Fetch the blocks of a pull job (runs on the source peer's lane)."""

    @abstractmethod
    def _on_push(self, header: dict, frames: list[zmq.Frame]) -> int:
        """Receiver side of a push: make the data land in our pool; returns bytes landed."""

    def _on_pull_request(self, header: dict) -> None:
        """Pull source side (tcp): send the requested blocks back. shm never gets one."""
        raise TransferError(f"{self.name} transport does not serve pull requests")

    # ---- send lanes (LaneWork) -------------------------------------------------------------
    def run_job(self, socket: LaneSocket, job: object) -> None:
        """Carry out one job on its peer's lane."""
        if isinstance(job, PushJob):
            started = time.perf_counter()
            num_bytes = self._send_push(socket, job)
            self.sent.note(job.transfer_id, time.perf_counter() - started, num_bytes)
        elif isinstance(job, PullJob):
            self._do_pull(socket, job)
        elif isinstance(job, StateJob):
            header = {"transfer_id": job.transfer_id, "hash": job.state_hash, "ready_at": job.ready_at}
            self.control.send(socket, b"STATE", header, memoryview(job.state))
            self.sent.note(job.transfer_id, 0.0, 0, len(job.state))
        elif isinstance(job, ControlJob):
            self.control.send(socket, job.kind, job.header)
        else:
            raise TransferError(f"not a KV send job: {type(job).__name__}")

    def fail_job(self, job: object, error: str) -> None:
        """A job that will not be carried out: the transfer it belongs to fails, alone."""
        transfer_id = job_transfer_id(job)
        logger.warning("KV %s transfer %s failed: %s", self.name, transfer_id, error)
        if isinstance(job, PushJob | StateJob):
            self.sent.note_error(transfer_id, error)
        elif isinstance(job, PullJob):
            self.arrivals.finish(transfer_id, f"pull from {job.peer.engine_id} failed: {error}")

    def handshake(self, socket: LaneSocket, peer: PeerInfo) -> PoolLayout:
        """Connection set-up: learn the peer's pool layout and check it matches ours."""
        self.control.send(socket, b"HELLO", {"engine_id": self.engine_id})
        try:
            reply = self.control.receive_reply(socket)
        except zmq.Again as exc:
            raise TransferError(
                f"KV peer {peer.engine_id} at {peer.host}:{peer.port} did not answer"
            ) from exc
        try:
            layout = layout_from_hello(reply)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"KV peer {peer.engine_id} answered a malformed HELLO") from exc
        mine = self.layout()
        if layout.dtype != mine.dtype:  # one dtype's bytes read as another's: garbage, no error
            why = f"KV cache dtypes differ, ours {mine.dtype}, peer {peer.engine_id} {layout.dtype}"
            raise TransferError(f"KV pool layouts differ: {why}: start both with the same --kv-cache-dtype")
        if layout.shape[0] != mine.shape[0] or layout.shape[3:] != mine.shape[3:]:
            raise TransferError(f"KV pool layouts differ: ours {mine.shape} {mine.dtype}, peer {layout}")
        if reply.get("state_bytes", 0) != self.state_bytes:
            raise TransferError(f"Mamba state sizes differ: ours {self.state_bytes}, peer {reply}")
        self.control.start_session(socket, reply, peer.engine_id)
        socket.peer_pool = self._on_handshake(peer, layout)
        socket.peer_layout = layout
        self._on_hello_reply(socket, peer, reply)
        return layout

    def hello_fields(self) -> dict:
        """What this engine answers a HELLO with (over the authenticated control channel)."""
        return {**self.layout()._asdict(), "state_bytes": self.state_bytes}

    def _on_hello_reply(self, socket: LaneSocket, peer: PeerInfo, reply: dict) -> None:
        """Connection set-up's last step, with the peer's whole HELLO answer (nixl: its agent)."""
        return None

    def peer_gone(self, socket: LaneSocket) -> bool:
        """Whether the lane's peer has certainly exited (shm: its mapped pool's owner).
        Over a network socket nothing tells, and nothing of the peer is held here."""
        return False

    def _ask_held(self, socket: LaneSocket, job: PullJob) -> bool:
        """Does the pull source still hold the job's blocks, with KV of its hashes?"""
        header = {"transfer_id": job.transfer_id, "src": job.src_block_ids, "hashes": job.block_hashes}
        self.control.send(socket, b"HELD", header)
        try:
            return bool(self.control.receive_reply(socket)["held"])
        except zmq.Again as exc:
            raise TransferError("the pull source did not answer") from exc

    def _on_handshake(self, peer: PeerInfo, layout: PoolLayout) -> torch.Tensor | None:
        """The peer's pool mapped here, when the transport writes into it (shm)."""
        return None

    # ---- receiver thread -----------------------------------------------------------------
    def _receive_loop(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_POLL_MS):
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._dispatch(frames)
                    except Exception:  # a malformed frame must not kill the receiver
                        logger.exception("bad KV control message")
            self.arrivals.check_deadlines()
            self._lanes.check_stalls()
        self._router.close(linger=0)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        message = self.control.open(frames)
        if message is None:
            return
        assert self._router is not None
        kind, header = message.kind, message.header
        if kind == b"HELLO":
            answer = self.control.hello_answer(message, self.hello_fields())
            self.control.reply(self._router, message, answer)
        elif kind == b"PUSH":
            blocks = [int(block) for block in header["dst"]]
            with self._landing:
                if not self.arrivals.accepts(header["transfer_id"], blocks, header.get("hashes", [])):
                    # even a token holder writes only the blocks reserved for its transfer,
                    # and only KV of the tokens the transfer is bound to
                    logger.warning("dropped a KV push outside its transfer's blocks or tokens")
                    return
                num_bytes = self._on_push(header, message.data)
                self.record_arrival(
                    header["transfer_id"], header["layer"], header["dst"], num_bytes, header["ready_at"]
                )
        elif kind == b"STATE":
            state = bytes(message.data[0].buffer) if message.data else b""
            with self._landing:
                self.arrivals.land_state(header["transfer_id"], state, header["hash"], header["ready_at"])
        elif kind == b"HELD":
            blocks, hashes = [int(block) for block in header["src"]], list(header.get("hashes", []))
            held = self.is_held(header["transfer_id"], blocks, hashes) if self.is_held is not None else True
            self.control.reply(self._router, message, {"held": held})
        elif kind == b"GRANT":
            grant = self.arrivals.grant(header["transfer_id"])
            blocks, hashes = grant if grant is not None else (None, [])
            self.control.reply(self._router, message, {"blocks": blocks, "hashes": hashes})
        elif kind == b"PULL":
            self._on_pull_request(header)
        elif kind == b"RELEASE":
            if self.on_release is not None:
                self.on_release(header["transfer_id"])
        elif kind == b"FAIL":
            self.arrivals.finish(header["transfer_id"], f"sender failed: {header.get('error')}")
        else:
            logger.warning("unknown KV message %r", kind)
