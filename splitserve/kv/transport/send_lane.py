"""Per-peer send lanes: one queue, one thread and one DEALER socket per destination peer.

A peer that stops answering (SIGSTOPped, killed, unreachable) delays only the jobs bound
for it. A lane whose current job (or connection set-up) makes no progress within a short
bound is declared stalled: its queued jobs fail at once through the transport's failure
path (that request alone is recomputed by decode, or reported as failed), later jobs to
the peer fail at once during a cool-down, and after it a fresh lane probes the peer with a
handshake before it accepts work again. Every wait on a lane is bounded; every blocking
socket call polls in short slices so a stalled or closing lane gives up at once.

Each lane thread closes its own socket on the way out; the transport destroys the shared
ZeroMQ context only after every lane thread has exited (libzmq aborts with "Assertion
failed: pfd.revents & POLLIN (src/signaler.cpp:238)" when a socket is closed or its
context destroyed while another thread still polls it).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

import zmq

from splitserve.kv.transport.frame_mac import SenderSession
from splitserve.kv.transport.types import Barrier, CallbackJob, PeerInfo, PoolLayout, TransferError

if TYPE_CHECKING:
    import torch

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "STALLED_PEER_S",
    "LaneAbandoned",
    "LaneSocket",
    "LaneWork",
    "SendLanes",
    "job_transfer_id",
]

logger = logging.getLogger(__name__)

# A live peer's receiver thread answers a control message within milliseconds and a layer's
# copy takes milliseconds, so 2 s without progress means the peer is stopped, dead or
# unreachable even on a loaded 2-core host; it is far below the KV timeout (30 s), which
# is what a dead peer used to cost every stream of the engine.
STALLED_PEER_S = 2.0
# Connection set-up adds a TCP connect and the peer's first reply to the same bound.
HANDSHAKE_TIMEOUT_S = 3.0
# After a stall the peer is left alone this long (doubling per repeated stall up to the
# cap), so a peer that stays dead costs each request one immediate failure, not a wait.
COOL_DOWN_S = 2.0
MAX_COOL_DOWN_S = 30.0
# A lane with nothing to send for this long ends its thread and socket: peers come and go
# (a restarted decode worker listens on a new port), lanes must not pile up.
IDLE_LANE_S = 120.0
# An idle lane asks this often whether its peer is gone (`LaneWork.peer_gone`): a lane
# holding a dead peer's mapped pool keeps that pool's memory alive while it lasts.
PEER_CHECK_S = 0.5
POLL_S = 0.02
_RETIRED = "the KV send lane retired after idling"


class LaneAbandoned(TransferError):
    """The lane was declared stalled or the transport is closing: give up the job."""


class _LaneRetired(TransferError):
    """The lane ended idle: a fresh one takes the job."""


class LaneWork(Protocol):
    """What a lane runs: the transport's data plane."""

    def handshake(self, socket: LaneSocket, peer: PeerInfo) -> PoolLayout: ...

    def run_job(self, socket: LaneSocket, job: object) -> None: ...

    def fail_job(self, job: object, error: str) -> None: ...

    def peer_gone(self, socket: LaneSocket) -> bool: ...


class _CoolDown(NamedTuple):
    until: float  # monotonic
    seconds: float
    error: str


class LaneSocket:
    """A lane's DEALER socket whose blocking calls poll in slices: each completed call is
    progress, and a call gives up once the lane is abandoned or `timeout_s` has passed."""

    def __init__(self, socket: zmq.Socket, lane: SendLane, timeout_s: float):
        self.socket = socket
        self.lane = lane
        self.timeout_s = timeout_s
        self.peer_pool: torch.Tensor | None = None  # the peer's pool mapped here (shm)
        self.peer_layout: PoolLayout | None = None  # what the peer answered at connection set-up
        self.peer_state: object | None = None  # a transport's own per-peer state (nixl: its agent)
        self.session = SenderSession()  # issued by the peer at HELLO; stamps every message
        self.last_stamp = b""  # of the last request sent: its reply must be bound to it

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                # a multipart message is accepted whole or not at all (HWM counts messages)
                self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                break
            except zmq.Again:
                self._wait(zmq.POLLOUT, deadline)
        self.lane.progressed()

    def recv_multipart(self) -> list[bytes]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
                break
            except zmq.Again:
                self._wait(zmq.POLLIN, deadline)
        self.lane.progressed()
        return frames

    def _wait(self, event: int, deadline: float) -> None:
        self.lane.raise_if_abandoned()
        if time.monotonic() > deadline:
            raise zmq.Again()
        self.socket.poll(int(POLL_S * 1000), event)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold while touching a pool: a lane is never abandoned mid-copy, and no copy
        starts after it was (its transfer has already been failed)."""
        with self.lane.lock:
            self.lane.raise_if_abandoned()
            yield


class SendLane:
    """One destination peer's queue and thread."""

    def __init__(
        self,
        peer: PeerInfo,
        owner: SendLanes,
        probing: bool,
    ):
        self.peer = peer
        self.owner = owner
        self.probing = probing  # the peer stalled before: no work until it answers
        self.lock = threading.Lock()
        self.jobs: queue.Queue = queue.Queue(maxsize=owner.max_queued_jobs)
        self.ready = threading.Event()  # the handshake succeeded
        self.error: str | None = None  # set once: the lane is abandoned
        self.busy_since: float | None = None
        self.busy_bound = owner.handshake_timeout_s
        self.thread = threading.Thread(target=self._run, name=f"kv-lane-{peer.host}:{peer.port}", daemon=True)

    # ---- any thread ------------------------------------------------------------------
    def put(self, job: object, timeout_s: float) -> None:
        """Queue a job; raises TransferError when the lane is abandoned, probing, or its
        queue stays full past `timeout_s` (a stall is declared sooner than that)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if self.error == _RETIRED:
                    raise _LaneRetired(self.error)
                if self.error is not None:
                    raise TransferError(self.error)
                if self.probing and not self.ready.is_set():
                    raise TransferError(f"KV peer {self.peer.engine_id} is being probed after a stall")
                try:
                    self.jobs.put_nowait(job)
                    return
                except queue.Full:
                    pass
            now = time.monotonic()
            self.check_stall(now)
            if now > deadline:
                raise TransferError(
                    f"KV send queue to {self.peer.engine_id} stayed full for {timeout_s:.1f}s"
                )
            time.sleep(POLL_S)

    def progressed(self) -> None:
        self.busy_since = time.monotonic()

    def check_stall(self, now: float) -> None:
        busy_since = self.busy_since
        if busy_since is not None and now - busy_since > self.busy_bound:
            what = "connection set-up" if not self.ready.is_set() else "its transfers"
            self.abandon(
                f"KV peer {self.peer.engine_id} at {self.peer.host}:{self.peer.port} made no progress"
                f" on {what} for {self.busy_bound:.1f}s (stalled or dead)"
            )

    def abandon(self, error: str) -> None:
        """Fail every queued job now and refuse new ones; the thread gives up its current
        job at its next poll slice and exits."""
        with self.lock:
            if self.error is not None:
                return
            self.error = error
            drained = self._drain()
        logger.warning("KV send lane abandoned: %s", error)
        self.owner.lane_abandoned(self, error)
        self._fail_all(drained, error)

    def raise_if_abandoned(self) -> None:
        if self.error is not None:
            raise LaneAbandoned(self.error)
        if self.owner.stop.is_set():
            raise LaneAbandoned("the KV transport is closing")

    def _drain(self) -> list[object]:
        drained = []
        while True:
            try:
                drained.append(self.jobs.get_nowait())
            except queue.Empty:
                return drained

    def _fail_all(self, jobs: list[object], error: str) -> None:
        for job in jobs:
            if isinstance(job, Barrier):
                job.event.set()  # nothing before it will be sent any more
            elif not isinstance(job, CallbackJob) and not self.owner.stop.is_set():
                self.owner.work.fail_job(job, error)

    # ---- the lane's thread -----------------------------------------------------------
    def _run(self) -> None:
        self.progressed()
        socket: zmq.Socket | None = None
        try:
            socket = self.owner.new_socket(self.peer)
            lane_socket = LaneSocket(socket, self, self.owner.timeout_s)
            self.owner.work.handshake(lane_socket, self.peer)
            self.busy_since = None
            self.busy_bound = self.owner.stalled_peer_s
            self.ready.set()
            self.owner.lane_ready(self)
            self._serve(lane_socket)
        except LaneAbandoned:
            pass
        except Exception as exc:  # connection set-up failed: the lane cannot carry anything
            self.abandon(f"KV peer {self.peer.engine_id} at {self.peer.host}:{self.peer.port}: {exc}")
        finally:
            if socket is not None:
                socket.close(linger=0)
            with self.lock:
                self.error = self.error or "the KV transport is closing"
                drained = self._drain()
            self._fail_all(drained, self.error)

    def _serve(self, lane_socket: LaneSocket) -> None:
        idle_since = checked_at = time.monotonic()
        while self.error is None and not self.owner.stop.is_set():
            try:
                job = self.jobs.get(timeout=POLL_S)
            except queue.Empty:
                now, gone = time.monotonic(), False
                if now - checked_at > PEER_CHECK_S:
                    # a restarted peer is a new engine (a new ID, maybe a new port): nothing
                    # comes for this lane again, so it ends (its mapping too) now, not idle
                    checked_at, gone = now, self.owner.work.peer_gone(lane_socket)
                if gone or now - idle_since > self.owner.idle_lane_s:
                    with self.lock:
                        if self.jobs.empty():
                            self.error = _RETIRED
                    if gone:
                        logger.info("KV peer %s is gone: its send lane ends", self.peer.engine_id)
                continue
            idle_since = time.monotonic()
            if isinstance(job, Barrier):
                job.event.set()
                continue
            if isinstance(job, CallbackJob):
                with contextlib.suppress(Exception):
                    job.fn()
                continue
            self.progressed()
            try:
                self.owner.work.run_job(lane_socket, job)
            except LaneAbandoned:
                self.owner.work.fail_job(job, self.error or "the KV transport is closing")
                raise
            except zmq.Again:
                self.owner.work.fail_job(job, f"KV peer {self.peer.engine_id} did not answer")
            except Exception as exc:  # one job's failure (a bad header, a lost hold) is its own
                self.owner.work.fail_job(job, str(exc))
            finally:
                self.busy_since = None


class SendLanes:
    """Every lane of one transport, the peers cooling down after a stall, and the threads
    still to be joined at close."""

    def __init__(
        self,
        work: LaneWork,
        context: zmq.Context,
        socket_options: dict[int, int],
        max_queued_jobs: int,
        timeout_s: float,
        stalled_peer_s: float | None = None,  # None: STALLED_PEER_S
        handshake_timeout_s: float | None = None,  # None: HANDSHAKE_TIMEOUT_S
    ):
        self.work = work
        self.context = context
        self.socket_options = socket_options
        self.max_queued_jobs = max_queued_jobs
        self.timeout_s = timeout_s
        # never longer than the operator's KV timeout
        self.stalled_peer_s = min(STALLED_PEER_S if stalled_peer_s is None else stalled_peer_s, timeout_s)
        self.handshake_timeout_s = min(
            HANDSHAKE_TIMEOUT_S if handshake_timeout_s is None else handshake_timeout_s, timeout_s
        )
        self.idle_lane_s = IDLE_LANE_S
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._lanes: dict[PeerInfo, SendLane] = {}
        self._cooling: dict[PeerInfo, _CoolDown] = {}
        self._threads: list[threading.Thread] = []

    def new_socket(self, peer: PeerInfo) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        for option, value in self.socket_options.items():
            socket.setsockopt(option, value)
        socket.connect(f"tcp://{peer.host}:{peer.port}")
        return socket

    def put(self, peer: PeerInfo, job: object, timeout_s: float | None = None) -> None:
        try:
            self._lane_for(peer).put(job, self.timeout_s if timeout_s is None else timeout_s)
        except _LaneRetired:
            self._lane_for(peer).put(job, self.timeout_s if timeout_s is None else timeout_s)

    def _lane_for(self, peer: PeerInfo) -> SendLane:
        with self._lock:
            if self.stop.is_set():
                raise TransferError("the KV transport is closed")
            lane = self._lanes.get(peer)
            if lane is not None and lane.error is None:
                return lane
            cooling = self._cooling.get(peer)
            if cooling is not None and time.monotonic() < cooling.until:
                raise TransferError(f"{cooling.error}; not retried for {cooling.seconds:.0f}s")
            lane = SendLane(peer, self, probing=cooling is not None)
            # the lanes that ended stay only while their threads run: peers come and go
            self._lanes = {
                p: old for p, old in self._lanes.items() if old.error is None or old.thread.is_alive()
            }
            self._lanes[peer] = lane
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            self._threads.append(lane.thread)
            lane.thread.start()
            return lane

    def lane_abandoned(self, lane: SendLane, error: str) -> None:
        with self._lock:
            if self.stop.is_set():
                return
            previous = self._cooling.get(lane.peer)
            seconds = COOL_DOWN_S if previous is None else min(2 * previous.seconds, MAX_COOL_DOWN_S)
            self._cooling[lane.peer] = _CoolDown(time.monotonic() + seconds, seconds, error)

    def lane_ready(self, lane: SendLane) -> None:
        with self._lock:
            self._cooling.pop(lane.peer, None)

    def check_stalls(self) -> None:
        """Declare stalled every lane stuck past its bound (the receiver thread calls this
        every poll, so lanes nobody waits on are caught too)."""
        now = time.monotonic()
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.check_stall(now)

    def flush(self, timeout_s: float) -> set[PeerInfo]:
        """Wait until every job queued before now on any lane has been handed over (or
        failed with its stalled lane); the peers whose lanes had not when `timeout_s`
        passed (none: all flushed)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            lanes = [lane for lane in self._lanes.values() if lane.error is None]
        barriers: list[tuple[SendLane, threading.Event]] = []
        for lane in lanes:
            barrier = Barrier(threading.Event())
            with contextlib.suppress(TransferError):  # abandoned or probing: nothing pending
                lane.put(barrier, max(0.0, deadline - time.monotonic()))
                barriers.append((lane, barrier.event))
        late: set[PeerInfo] = set()
        for lane, event in barriers:
            while not event.wait(POLL_S):
                now = time.monotonic()
                lane.check_stall(now)
                if now > deadline:
                    late.add(lane.peer)
                    break
        return late

    def close(self, join_timeout_s: float) -> bool:
        """Stop every lane and join its thread; True when all exited (each closed its own
        socket), so the context may be destroyed."""
        with self._lock:
            self.stop.set()
            threads = list(self._threads)
        deadline = time.monotonic() + join_timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


def job_transfer_id(job: object) -> str:
    transfer_id = getattr(job, "transfer_id", None)
    if transfer_id is not None:
        return str(transfer_id)
    header = getattr(job, "header", None)
    return str(header.get("transfer_id", "")) if isinstance(header, dict) else ""
