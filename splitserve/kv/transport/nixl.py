"""KV transport over NIXL (UCX underneath: RDMA, shared memory or TCP, whichever UCX finds).

Each engine registers its paged KV pool with one NIXL agent, once, and prepares a
descriptor per (layer, K/V, block). The control plane is the one every transport has
(base.py): HELLO, MACs and replay stamps, per-peer lanes, HELD/RELEASE/FAIL. NIXL's
agent metadata (its UCX address and the pool's remote keys) travels only in the answer
to an authenticated HELLO, never over a socket of NIXL's own (its listener stays off).

Push: before a transfer's first WRITE the sender asks the receiver for the transfer's
grant (GRANT: the blocks and block hashes decode reserved) over the control channel and
refuses to write anything outside it; each layer is then one NIXL WRITE into the granted
blocks, and its notification, sent by NIXL once the WRITE has landed, carries the layer's
descriptor list (transfer, layer, blocks, hashes) sealed with the deployment's MAC and a
replay stamp of its own session. The receiver's notification thread opens it and checks
the list against the grant: a notification naming other blocks or other tokens fails the
transfer (decode recomputes), and the transfer completes only once every (layer, block)
of the grant, and nothing else, has been notified, so its descriptor list equals the grant.

Pull (decode reading prefill's held blocks, prefill reading decode's lent prefix): HELD,
one NIXL READ per layer, HELD again, then RELEASE, as the shm transport does.

What one-sided RDMA leaves open, and how far it reaches, is in docs/pd.md ("NIXL").
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import zmq

from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.frame_mac import STAMP_BYTES, TAG_BYTES, SenderSession
from splitserve.kv.transport.nixl_package import load_nixl
from splitserve.kv.transport.send_lane import LaneSocket
from splitserve.kv.transport.types import PeerInfo, PullJob, PushJob, TransferError

logger = logging.getLogger(__name__)

# The receiver looks for notifications this often while it expects a transfer (a layer's
# arrival is seen this late at most), and this often when it expects none.
NOTIFY_POLL_BUSY_S = 0.0005
NOTIFY_POLL_IDLE_S = 0.02
# A sender polls its WRITE or READ this often until NIXL reports it done.
TRANSFER_POLL_S = 0.0001
MAX_CACHED_GRANTS = 256  # per lane: transfers whose grant the sender holds
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class RemoteAgent:
    """A peer's agent as loaded here, shared by the lanes to it: its blocks as prepared
    descriptors, until it disconnects (then the handle is released and never used again)."""

    def __init__(self, name: str, blocks: object, num_blocks: int):
        self.name = name
        self.blocks = blocks  # nixl_prepped_dlist_handle: one descriptor per (layer, k/v, block)
        self.num_blocks = num_blocks
        self.disconnected = False


class NixlPeer:
    """A lane's view of its peer: the peer's agent, the session that stamps our
    notifications to it, and the grants it answered."""

    def __init__(self, remote: RemoteAgent, notifications: SenderSession):
        self.remote = remote
        self.notifications = notifications
        # transfer -> {block: hash of the KV it must hold, or None when not bound to tokens}
        self.grants: OrderedDict[str, dict[int, str | None]] = OrderedDict()


def block_descriptors(address: int, shape: tuple[int, ...], element_size: int, device: int) -> np.ndarray:
    """(address, length, device) of every block of a pool `[layers, 2, blocks, ...]`, in
    the order `block_index` counts them."""
    block_bytes = int(np.prod(shape[3:])) * element_size
    count = shape[0] * shape[1] * shape[2]
    descriptors = np.empty((count, 3), dtype=np.uint64)
    descriptors[:, 0] = address + np.arange(count, dtype=np.uint64) * block_bytes
    descriptors[:, 1] = block_bytes
    descriptors[:, 2] = device
    return descriptors


def block_index(num_blocks: int, layer: int, block_ids: list[int]) -> np.ndarray:
    """The descriptors of one layer's blocks, K then V: the same order on both sides."""
    blocks = np.asarray(block_ids, dtype=np.int32)
    return np.concatenate([(layer * 2 + kv) * num_blocks + blocks for kv in (0, 1)]).astype(np.int32)


class NixlTransport(KVTransport):
    name = "nixl"
    stops_at_once = False  # a peer writes into our pool itself: we cannot stop it mid-write

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._nixl = load_nixl()
        except ImportError as exc:
            raise TransferError(str(exc)) from exc
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent's start to stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.agent_name = f"{self.engine_id}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent: Any = None  # nixl_agent, once the pool is registered
        self._transfer_failed = False  # a WRITE or READ failed: UCX may hold a request still
        self._registration: Any = None  # the pool's nixlRegDList
        self._local_blocks: Any = None  # nixl_prepped_dlist_handle of our blocks
        self._remote_agents: dict[str, RemoteAgent] = {}
        self._agents_lock = threading.Lock()
        self.notifications_dropped = 0

    # ---- pool and agent --------------------------------------------------------------------
    def allocate_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        self.pool = torch.zeros(tuple(shape), dtype=dtype, device=device)
        return self.pool

    def _memory(self) -> tuple[str, int]:
        assert self.pool is not None
        return ("DRAM", 0) if self.pool.device.type == "cpu" else ("VRAM", self.pool.get_device())

    def _register_pool(self) -> None:
        """The pool registered with a new agent, once (at start, the pool is the engine's)."""
        if self.pool is None:
            raise TransferError("the KV pool is not allocated yet")
        if not self.pool.is_contiguous():
            raise TransferError("the nixl KV transport needs a contiguous KV pool")
        if self.host in LOOPBACK_HOSTS:
            # UCX's own endpoints are not under the deployment's MAC: an engine whose KV
            # socket is loopback-only keeps UCX on loopback too (an operator's value wins)
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        nixl = self._nixl
        config = nixl.nixl_agent_config(
            # NIXL's progress thread spins (no delay): on an engine pinned to its cores it
            # took prefill's CPU (an 8k prompt's TTFT 4x); our polls progress UCX instead
            enable_prog_thread=False,
            enable_listen_thread=False,  # metadata goes over our authenticated channel only
            backends=["UCX"],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # lanes + notifications
        )
        agent = nixl.nixl_agent(self.agent_name, config)
        if "UCX" not in agent.backends:
            raise TransferError("NIXL has no UCX backend here (plugin missing)")
        self._registration = agent.register_memory(self.pool)
        memory, device = self._memory()
        shape, size = tuple(self.pool.shape), self.pool.element_size()
        descriptors = block_descriptors(self.pool.data_ptr(), shape, size, device)
        self._local_blocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descriptors, memory)
        self._agent = agent

    def start(self) -> PeerInfo:
        if self._router is not None:
            return self.peer_info()
        self._register_pool()
        peer = super().start()
        thread = threading.Thread(target=self._notification_loop, name="kv-nixl-notify", daemon=True)
        thread.start()
        self._threads.append(thread)
        return peer

    def hello_fields(self) -> dict:
        assert self._agent is not None and self.pool is not None
        memory, device = self._memory()
        return {
            **super().hello_fields(),
            "nixl_agent": self.agent_name,
            "nixl_metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "nixl_address": self.pool.data_ptr(),
            "nixl_memory": memory,
            "nixl_device": device,
        }

    def _release_pool(self) -> None:
        agent, self._agent = self._agent, None
        if agent is None:
            return
        with self._agents_lock, contextlib.suppress(Exception):  # best effort: may be exiting
            remotes, self._remote_agents = self._remote_agents, {}
            for name, remote in remotes.items():
                remote.disconnected = True
                agent.release_dlist_handle(remote.blocks)
                agent.remove_remote_agent(name)
            agent.release_dlist_handle(self._local_blocks)
            agent.deregister_memory(self._registration)
        if self._transfer_failed:
            keep_for_the_process(agent)

    # ---- connection set-up -------------------------------------------------------------------
    def _on_hello_reply(self, socket: LaneSocket, peer: PeerInfo, reply: dict) -> None:
        """Load the peer's agent (its metadata came with the authenticated HELLO answer),
        prepare its blocks once, and open the session that stamps our notifications."""
        assert self._agent is not None and socket.peer_layout is not None
        try:
            name, memory = str(reply["nixl_agent"]), str(reply["nixl_memory"])
            metadata = base64.b64decode(str(reply["nixl_metadata"]), validate=True)
            address, device = int(reply["nixl_address"]), int(reply["nixl_device"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"KV peer {peer.engine_id} has no NIXL agent (not a nixl engine?)") from exc
        if memory not in ("DRAM", "VRAM"):
            raise TransferError(f"KV peer {peer.engine_id} offered NIXL memory {memory!r}")
        shape = socket.peer_layout.shape
        with self._agents_lock:
            remote = self._remote_agents.get(name)
            if remote is None:
                loaded = self._agent.add_remote_agent(metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:
                    self._agent.remove_remote_agent(loaded)
                    raise TransferError(f"KV peer {peer.engine_id} sent the metadata of another agent")
                assert self.pool is not None
                descriptors = block_descriptors(address, shape, self.pool.element_size(), device)
                remote = RemoteAgent(name, self._agent.prep_xfer_dlist(name, descriptors, memory), shape[2])
                self._remote_agents[name] = remote
        notifications = SenderSession()
        hello = {"engine_id": self.engine_id, "session_for": "nixl notifications"}
        self.control.send(socket, b"HELLO", hello)
        try:
            answer = self.control.receive_reply(socket)
        except zmq.Again as exc:
            raise TransferError(f"KV peer {peer.engine_id} did not answer") from exc
        if self.control.mac.enabled:
            try:
                notifications.start(bytes.fromhex(str(answer["session"])))
            except (KeyError, ValueError) as exc:
                raise TransferError(f"KV peer {peer.engine_id} answered HELLO without a session") from exc
        socket.peer_state = NixlPeer(remote, notifications)

    def _forget_agent(self, remote: RemoteAgent) -> None:
        """Drop a peer's agent that disconnected (died): no lane posts to it again."""
        with self._agents_lock:
            if remote.disconnected:
                return
            remote.disconnected = True
            self._remote_agents.pop(remote.name, None)
            agent = self._agent
            if agent is not None:
                with contextlib.suppress(Exception):
                    agent.release_dlist_handle(remote.blocks)
                    agent.remove_remote_agent(remote.name)

    def _peer(self, socket: LaneSocket) -> NixlPeer:
        state = socket.peer_state
        if not isinstance(state, NixlPeer):
            raise TransferError("the KV lane has no NIXL peer (connection set-up incomplete)")
        return state

    # ---- sender ----------------------------------------------------------------------------
    def _grant(self, socket: LaneSocket, peer: NixlPeer, transfer_id: str) -> dict[int, str | None]:
        """The transfer's grant as the receiver answers it (asked once per chunk of layers)."""
        grant = peer.grants.get(transfer_id)
        if grant is not None:
            return grant
        self.control.send(socket, b"GRANT", {"transfer_id": transfer_id})
        try:
            answer = self.control.receive_reply(socket)
        except zmq.Again as exc:
            raise TransferError("the KV peer did not answer a grant query") from exc
        if answer.get("blocks") is None:
            raise TransferError(f"KV peer {socket.lane.peer.engine_id} expects no transfer {transfer_id}")
        blocks, hashes = [int(b) for b in answer["blocks"]], [str(h) for h in answer.get("hashes", [])]
        grant = dict(zip(blocks, hashes or [None] * len(blocks), strict=True))
        peer.grants[transfer_id] = grant
        while len(peer.grants) > MAX_CACHED_GRANTS:
            peer.grants.popitem(last=False)
        return grant

    def check_grant(self, grant: dict[int, str | None], job: PushJob) -> None:
        """Refuse (TransferError) a WRITE outside the transfer's blocks or of other tokens."""
        outside = sorted(set(job.dst_block_ids) - set(grant))
        if outside:
            raise TransferError(
                f"transfer {job.transfer_id} may write blocks {sorted(grant)}: "
                f"refused a NIXL WRITE to {outside}"
            )
        expected = [grant[block] for block in job.dst_block_ids]
        if any(h is not None for h in expected) and list(job.block_hashes) != expected:
            raise TransferError(f"transfer {job.transfer_id}: refused a NIXL WRITE of KV of other tokens")

    def _send_push(self, socket: LaneSocket, job: PushJob) -> int:
        assert self.pool is not None
        peer = self._peer(socket)
        self.check_grant(self._grant(socket, peer, job.transfer_id), job)
        if job.layer == self.pool.shape[0] - 1:
            peer.grants.pop(job.transfer_id, None)  # the next chunk asks again: still expected?
        layer_bytes = 2 * len(job.dst_block_ids) * self.pool[0, 0, 0].numel() * self.pool.element_size()
        header = {
            "transfer_id": job.transfer_id,
            "layer": job.layer,
            "dst": job.dst_block_ids,
            "ready_at": job.ready_at,
            "bytes": layer_bytes,
            "hashes": job.block_hashes,
        }
        notification = self._seal(peer.notifications, header)
        local = block_index(self.pool.shape[2], job.layer, job.src_block_ids)
        remote = block_index(peer.remote.num_blocks, job.layer, job.dst_block_ids)
        with socket.writing():  # our source blocks are not freed while NIXL reads them
            self._transfer("WRITE", local, peer, remote, notification)
        return layer_bytes

    def _transfer(
        self, operation: str, local: np.ndarray, peer: NixlPeer, remote: np.ndarray, note: bytes
    ) -> None:
        """Post one WRITE or READ and wait until it is done, within the lane's stall bound."""
        target, handle = peer.remote, None
        try:
            with self._agents_lock:  # the handles are not released while a transfer is posted
                agent = self._agent
                if agent is None:
                    raise TransferError("the KV transport is closed")
                if target.disconnected:
                    raise TransferError(f"a NIXL {operation} to {target.name} failed: it disconnected")
                handle = agent.make_prepped_xfer(
                    operation, self._local_blocks, local, target.blocks, remote, note
                )
                state = agent.transfer(handle)
            deadline = time.monotonic() + self._lanes.stalled_peer_s  # <= the KV timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"a NIXL {operation} to {target.name} made no progress")
                time.sleep(TRANSFER_POLL_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"a NIXL {operation} to {target.name} failed")
        except TransferError:
            self._transfer_failed = True
            raise
        except Exception as exc:  # nixlBind errors: the peer's agent disconnected (died), ...
            self._transfer_failed = True
            if "DISCONNECT" in str(exc):
                self._forget_agent(target)  # a dead peer's agent is not kept
            raise TransferError(f"a NIXL {operation} to {target.name} failed: {exc}") from exc
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # still in flight and not cancellable: NIXL keeps it
                    logger.warning("KV nixl: a %s to %s could not be released", operation, target.name)

    def _do_pull(self, socket: LaneSocket, job: PullJob) -> None:
        assert self.pool is not None
        peer = self._peer(socket)
        # Held before and after the read means held throughout: the blocks were not reused.
        if not self._ask_held(socket, job):
            raise TransferError(
                f"engine {job.peer.engine_id} no longer holds the blocks (or not of these tokens)"
            )
        layer_bytes = 2 * len(job.dst_block_ids) * self.pool[0, 0, 0].numel() * self.pool.element_size()
        for layer in range(self.pool.shape[0]):
            local = block_index(self.pool.shape[2], layer, job.dst_block_ids)
            remote = block_index(peer.remote.num_blocks, layer, job.src_block_ids)
            with socket.writing():  # never into blocks a failed pull gave back for recompute
                self._transfer("READ", local, peer, remote, b"")
            last = layer == self.pool.shape[0] - 1
            if last and not self._ask_held(socket, job):
                raise TransferError(f"engine {job.peer.engine_id} released the blocks during the read")
            self.record_arrival(job.transfer_id, layer, job.dst_block_ids, layer_bytes, None)
        self.control.send(socket, b"RELEASE", {"transfer_id": job.transfer_id})

    def _on_push(self, header: dict, frames: list[zmq.Frame]) -> int:
        raise TransferError("a nixl KV push arrives as a NIXL notification, not a control message")

    # ---- notifications ---------------------------------------------------------------------
    def _seal(self, session: SenderSession, header: dict) -> bytes:
        """A notification: tag + stamp + JSON with a key, the JSON alone without. Two
        frames under the MAC, so it is never a valid control message (three or more)."""
        body = json.dumps(header).encode()
        if not self.control.mac.enabled:
            return body
        stamp = session.next_stamp()
        tag = self.control.mac.seal([body, stamp])[-1]
        return tag + stamp + body

    def _open(self, message: bytes) -> dict | None:
        if self.control.mac.enabled:
            tag, stamp = message[:TAG_BYTES], message[TAG_BYTES : TAG_BYTES + STAMP_BYTES]
            body = message[TAG_BYTES + STAMP_BYTES :]
            if self.control.mac.open([body, stamp, tag]) is None:
                logger.warning("dropped a NIXL notification that failed authentication")
                return None
            if not self.control.sessions.admit(stamp):
                logger.warning("dropped a replayed NIXL notification (or of a session we did not issue)")
                return None
        else:
            body = message
        header = json.loads(body)
        return header if isinstance(header, dict) else None

    def on_notification(self, message: bytes) -> None:
        """A WRITE has landed: check its descriptor list against the grant, then count it."""
        header = self._open(message)
        if header is None:
            self.notifications_dropped += 1
            return
        transfer_id = str(header["transfer_id"])
        blocks, hashes = [int(block) for block in header["dst"]], list(header.get("hashes", []))
        if not self.arrivals.accepts(transfer_id, blocks, hashes):
            # the bytes are in our pool already: this transfer's KV is not trusted (an
            # expected one fails and decode recomputes it); one not expected is late data
            self.notifications_dropped += 1
            logger.warning("KV nixl: transfer %s wrote outside its grant or other tokens", transfer_id)
            self.arrivals.finish(transfer_id, "a NIXL WRITE outside the transfer's grant (or other tokens)")
            return
        ready_at = header.get("ready_at")
        num_bytes = int(header.get("bytes", 0))
        self.record_arrival(transfer_id, int(header["layer"]), blocks, num_bytes, ready_at)

    def _notification_loop(self) -> None:
        while not self._stop.is_set():
            agent = self._agent
            if agent is None:
                return
            try:
                notifications = agent.get_new_notifs()
            except Exception:
                logger.exception("KV nixl: reading notifications failed")
                notifications = {}
            for messages in notifications.values():
                for message in messages:
                    try:
                        self.on_notification(bytes(message))
                    except Exception:  # a malformed notification must not stop the others
                        self.notifications_dropped += 1
                        logger.exception("KV nixl: a bad notification")
            if not notifications:
                time.sleep(NOTIFY_POLL_BUSY_S if self.arrivals.pending() else NOTIFY_POLL_IDLE_S)


def keep_for_the_process(agent: Any) -> None:
    """Never destroy `agent`. A transfer to a peer that died can leave a request queued in
    UCX, and destroying the agent's worker then fails UCX's assertion
    `ucs_arbiter_group_is_empty` and aborts the whole process (an engine at shutdown, or a
    garbage collection any time later). Its memory is the process's until it exits."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))
