"""The P/D connector: both halves of the engine's KV seam for prefill and decode workers.

Push (default): the decode request arrives first with `do_remote_prefill`; after its own
prefix-cache match it reserves blocks for the missing positions and parks in
WAITING_FOR_REMOTE_KVS. The proxy reads that reservation and sends the prefill request
with `do_remote_decode` and the decode block IDs; the prefill worker ships each layer's
finished blocks from `save_kv_layer`, while the next layer computes. Decode counts the
arrivals and wakes its engine on the last one.

Pull (vLLM NIXL's behaviour, kept for comparison): the prefill worker finishes, holds its
blocks and returns where they are; decode reads them after it is scheduled, then tells
prefill to release them (or the hold expires after the TTL).

Concurrent reservation (push): the proxy may send the prefill request at once with
`push_target_pending`; prefill computes while decode reserves, and the proxy forwards the
reservation (`POST /inference/v1/kv/push_target`); the layers computed by then are queued
at once (`kv/connector/layer_push.py`).

Bidirectional (push): decode's reservation also offers the leading blocks it already
holds of the prompt, by chained block hash (`kv/connector/prefix_lend.py`); prefill pulls the run
whose hashes equal its own request's before computing the rest.

A transfer that fails or times out makes decode recompute the prompt itself; a prefix
pull that fails makes prefill compute those blocks itself.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.config import EngineRole, TransferConfig
from splitserve.kv.connector.base import ConnectorRequest, KVCacheAllocator, KVConnector, StepKVInfo
from splitserve.kv.connector.handoff_metrics import HandoffMetrics
from splitserve.kv.connector.layer_push import LayerPusher
from splitserve.kv.connector.pd_loads import Load, handoff_report, wall_to_monotonic
from splitserve.kv.connector.prefill_finish import push_finished
from splitserve.kv.connector.prefix_lend import (
    PrefixLends,
    prefill_prompt_sources,
    pullable_prefix_tokens,
)
from splitserve.kv.connector.reservations import HoldTable, Reservation, ReservationTable
from splitserve.kv.transport.arrivals import TransferResult
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.types import PeerInfo, TransferError
from splitserve.protocol.block_hash import cdiv
from splitserve.protocol.kv_transfer import KVParamsError, KVTransferParams, RemoteAddress

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)


class PDConnector(KVConnector):
    def __init__(
        self,
        role: EngineRole,
        config: TransferConfig,
        *,
        engine_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: KVTransport | None = None,
    ) -> None:
        self.role = role
        self.config = config
        self.engine_id = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.transport = transport or make_transport(self.engine_id, config, host, port)
        self.reservations = ReservationTable()
        self.holds = HoldTable(config.reservation_ttl_s, self._on_hold_released)
        self.lends = PrefixLends(config.reservation_ttl_s, self._on_lend_ended)
        self.transport.on_release = self._on_release
        self.transport.is_held = self._is_held
        self.metrics = HandoffMetrics(self._gauges)
        self._lock = threading.Lock()
        self._loads: dict[str, Load] = {}
        self._request_of_transfer: dict[str, str] = {}
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._freeable: set[str] = set()
        self._lent: set[str] = set()  # decode: requests whose prefix blocks are on loan
        self._finish_waits: dict[str, int] = {}  # finished requests: what still reads/writes their blocks
        self.pusher = LayerPusher(self.transport, config.timeout_s, config.reservation_ttl_s)
        self.pusher.on_parked_end = self._on_parked_end
        self._wakeup: Callable[[], None] | None = None
        self._abort: Callable[[str], object] | None = None
        self.block_size = 0
        self.num_layers = 0
        self.peer: PeerInfo | None = None

    # ---- set-up -----------------------------------------------------------------------
    def kv_cache_allocator(self) -> KVCacheAllocator:
        def allocate(shape: tuple[int, ...], *, dtype: torch.dtype, device: object = "cpu") -> torch.Tensor:
            return self.transport.allocate_pool(tuple(shape), dtype, str(device))

        return allocate

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        if self.transport.pool is None:
            self.transport.pool = kv_cache  # an allocator of the caller's: tcp can still send from it
        elif self.transport.pool.data_ptr() != kv_cache.data_ptr():
            raise TransferError("the engine's KV cache is not the transport's pool")
        self.block_size = self.pusher.block_size = block_size
        self.num_layers = self.pusher.num_layers = kv_cache.shape[0]
        self.peer = self.transport.start()

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def set_abort(self, abort: Callable[[str], object]) -> None:
        """How to end a request whose KV failed under failure_policy "fail" (thread-safe,
        e.g. `AsyncEngine.abort`). Without it, failed loads always recompute."""
        self._abort = abort

    def kv_address(self) -> RemoteAddress:
        """This worker's KV endpoint (remote_engine_id/host/port in kv_transfer_params)."""
        assert self.peer is not None
        return RemoteAddress(self.peer.engine_id, self.peer.host, self.peer.port)

    def _gauges(self) -> dict[str, float]:
        return {
            "reservations_active": self.reservations.active(),
            "reserved_blocks": self.reservations.reserved_blocks(),
            "holds_active": self.holds.active(),
            "prefix_lends_active": self.lends.active(),
        }

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup()

    # ---- scheduler half ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Side-effect free (vLLM's contract): it may be asked again for the same request."""
        params = request.kv_transfer_params
        if params.do_remote_decode:
            mode = params.mode(self.config.mode)
            return pullable_prefix_tokens(request, num_computed_tokens, params, self.block_size, mode), True
        if not params.do_remote_prefill:
            return 0, False
        external = request.num_prompt_tokens - 1 - num_computed_tokens
        if external <= 0:
            return 0, False
        if params.mode(self.config.mode) == "pull":
            try:
                params.remote_address()
                params.block_ids()
            except KVParamsError as exc:
                logger.warning("request %s computes its prompt itself: %s", request.request_id, exc)
                return 0, False
        prefill_ids = params.prompt_token_ids
        if prefill_ids is not None and list(prefill_ids) != request.prompt_token_ids:
            # KV computed for other tokens must never be attended to (the seed's midnight case)
            logger.warning("request %s: prefill computed other token IDs; recomputing", request.request_id)
            self.metrics.fallbacks.labels("token_mismatch").inc()
            return 0, False
        return external, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params.do_remote_decode:
            if params.mode(self.config.mode) == "push":
                self.pusher.plan(
                    request.request_id, request.num_prompt_tokens, params, request.prompt_kv_hashes()
                )
                if num_external_tokens > 0:
                    self._pull_prefix(request, block_ids, num_external_tokens, params)
            return
        if not params.do_remote_prefill:
            return
        request_id, bs = request.request_id, self.block_size
        needed = request.num_prompt_tokens - 1
        if num_external_tokens <= 0:
            # Nothing travels (a full local hit, or unusable params): an empty reservation
            # tells the proxy to skip prefill.
            first = cdiv(needed, bs)
            self.reservations.add(Reservation(request_id, [], first, needed, needed, time.monotonic()))
            return
        hit = request.num_computed_tokens
        first, last = hit // bs, cdiv(hit + num_external_tokens, bs)
        dst = list(block_ids[first:last])
        mode = params.mode(self.config.mode)
        transfer_id = request_id if mode == "push" else params.remote_request_id or request_id
        load = Load(transfer_id, mode, time.monotonic())
        if mode == "pull" and params.prefill_done_at is not None:
            load.ready_mono = wall_to_monotonic(params.prefill_done_at)
        with self._lock:
            self._loads[request_id] = load
            self._request_of_transfer[transfer_id] = request_id
        # the grant is bound to this prompt's tokens and salt: KV of anything else is refused
        hashes = request.prompt_kv_hashes()[first:last]
        ttl_s = self.config.reservation_ttl_s
        self.transport.expect(transfer_id, dst, self._on_transfer_done, ttl_s=ttl_s, block_hashes=hashes)
        if mode == "push":
            lend = self._lend_prefix(request, block_ids[:first])
            num_tokens = hit + num_external_tokens
            self.reservations.add(
                Reservation(request_id, dst, first, hit, num_tokens, time.monotonic(), *lend)
            )
            return
        src = params.block_ids()[first:last]
        if len(src) != len(dst):
            self.transport.fail(transfer_id, f"prefill holds {len(src)} of the {len(dst)} blocks needed")
            return
        self.transport.pull(PeerInfo(*params.remote_address()), transfer_id, list(src), dst, hashes)

    def _pull_prefix(
        self,
        request: ConnectorRequest,
        block_ids: list[int],
        num_external_tokens: int,
        params: KVTransferParams,
    ) -> None:
        """Prefill: read decode's lent blocks [our hit, our hit + external) into ours."""
        offer = params.prefix_offer()
        assert offer is not None  # pullable_prefix_tokens found one
        lend_id, lent_ids, _hashes = offer
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        load = Load(lend_id, "prefix", time.monotonic(), num_blocks=last - first)
        with self._lock:
            self._loads[request.request_id] = load
            self._request_of_transfer[lend_id] = request.request_id
        request.metrics["pulled_tokens"] = num_external_tokens
        dst = list(block_ids[first:last])
        hashes = [block_hash.hex() for block_hash in request.block_hashes[first:last]]
        ttl_s = self.config.reservation_ttl_s
        self.transport.expect(lend_id, dst, self._on_transfer_done, ttl_s=ttl_s, block_hashes=hashes)
        peer = PeerInfo(*params.remote_address())
        self.transport.pull(peer, lend_id, list(lent_ids[first:last]), dst, hashes)

    # ---- decode's prefix lends ----------------------------------------------------------
    def _lend_prefix(self, request: ConnectorRequest, blocks: list[int]) -> tuple[str | None, tuple, tuple]:
        """Lease our prefix-cache hit (matched by this request's block hashes) to the
        prefill worker: (lend ID, block IDs, hex hashes) for the reservation."""
        if not blocks:
            return None, (), ()
        with self._lock:
            self._lent.add(request.request_id)
        self.metrics.prefix_blocks.labels("lent").inc(len(blocks))
        hashes = tuple(h.hex() for h in request.block_hashes[: len(blocks)])
        return self.lends.lend(request.request_id, blocks, hashes), tuple(blocks), hashes

    def _is_held(self, transfer_id: str, block_ids: list[int], block_hashes: list[str]) -> bool:
        return self.holds.is_held(transfer_id, block_ids, block_hashes) or self.lends.is_held(
            transfer_id, block_ids, block_hashes
        )

    def _on_release(self, transfer_id: str) -> None:
        if not self.lends.release(transfer_id):
            self.holds.release(transfer_id)

    def _on_lend_ended(self, request_id: str, expired: bool) -> None:
        with self._lock:
            self._lent.discard(request_id)
            if request_id in self._finish_waits:
                self._finish_one(request_id)
        self.metrics.prefix_lends.labels("expired" if expired else "ended").inc()
        self._wake()

    def _finish_one(self, request_id: str) -> None:
        """Under the lock: one reader or writer of a finished request's blocks is done."""
        left = self._finish_waits.get(request_id, 1) - 1
        if left > 0:
            self._finish_waits[request_id] = left
        else:
            self._finish_waits.pop(request_id, None)
            self._freeable.add(request_id)

    def _on_transfer_done(self, result: TransferResult) -> None:
        """Transport thread: the last layer arrived, or the transfer failed."""
        now = time.monotonic()
        with self._lock:
            request_id = self._request_of_transfer.pop(result.transfer_id, None)
            load = self._loads.get(request_id) if request_id else None
            if load is None or request_id is None:
                return
            # a prefix pull is an optimization: failing it only means computing those blocks
            fail_request = self.config.failure_policy == "fail" and self._abort is not None
            fail_request = fail_request and load.mode != "prefix"
            load.done, load.ok, load.error = True, result.ok, result.error
            load.num_bytes = result.num_bytes
            load.last_arrival_mono = wall_to_monotonic(result.last_arrival) if result.last_arrival else now
            load.transfer_s = load.last_arrival_mono - load.started
            if result.sender_ready_at is not None and load.mode == "push":
                load.ready_mono = wall_to_monotonic(result.sender_ready_at)
            if load.orphaned:
                self._loads.pop(request_id, None)
                self._finish_one(request_id)
            elif result.ok:
                self._loaded.add(request_id)
            elif not fail_request:
                self._failed.add(request_id)
        side = "prefix_pull" if load.mode == "prefix" else "decode"
        if load.mode != "prefix":
            self.reservations.remove(request_id, expired=not result.ok and result.first_arrival is None)
            if result.ok:  # prefill has pushed, so it is done reading our prefix
                self.lends.release_for(request_id)
        if not result.ok:
            logger.warning("KV transfer %s for %s failed: %s", side, request_id, result.error)
        fallback = None if result.ok or load.orphaned else "fail" if fail_request else "recompute"
        self.metrics.count_arrival(side, result, load.num_blocks, load.transfer_s, fallback)
        if fallback == "fail" and self._abort is not None:
            self._abort(request_id)
        self._wake()

    def get_finished_loading(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            loaded, self._loaded = self._loaded, set()
            for request_id in loaded:
                load = self._loads.get(request_id)
                if load is not None and load.last_arrival_mono is not None:
                    load.noticed_mono = now
                    self.metrics.notification_delay.observe(max(0.0, now - load.last_arrival_mono))
        return loaded

    def get_failed_loading(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def get_finished_sending(self) -> set[str]:
        with self._lock:
            freeable, self._freeable = self._freeable, set()
        return freeable

    def fail_transfer(self, request_id: str, error: str) -> bool:
        """Give up waiting for a request's KV now (the proxy saw its prefill fail)."""
        with self._lock:
            load = self._loads.get(request_id)
            transfer_id = load.transfer_id if load is not None and not load.done else None
        if transfer_id is None:
            return False
        self.transport.fail(transfer_id, error)
        return True

    def _end_load(self, request_id: str) -> tuple[Load | None, bool]:
        """The request finished: its load, and whether bytes may still land in its blocks
        (then it is orphaned, and its blocks wait until the transport is done with them)."""
        with self._lock:
            load = self._loads.get(request_id)
            if load is not None and not load.done:
                load.orphaned = True
                self._finish_waits[request_id] = self._finish_waits.get(request_id, 0) + 1
                return load, True
            self._loads.pop(request_id, None)
            return load, False

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if params.do_remote_decode:
            load, in_flight = self._end_load(request.request_id)
            delay, report = self._prefill_finished(request, block_ids, params, load)
            return delay or in_flight, report
        if not params.do_remote_prefill:
            return False, None
        request_id = request.request_id
        load, in_flight = self._end_load(request_id)
        with self._lock:
            lent = request_id in self._lent  # a prefill worker may still read our prefix
            if lent:
                self._finish_waits[request_id] = self._finish_waits.get(request_id, 0) + 1
        if in_flight:
            # Ended before its KV arrived (its client left, or it was aborted): where the
            # transport can promise nothing lands afterwards, its reservation ends now
            # instead of at the TTL (the orphaned load then frees the blocks).
            assert load is not None
            self.transport.stop(load.transfer_id, "the request ended before its KV arrived")
            return True, None
        reservation = self.reservations.remove(request_id)
        if load is None:
            cached = reservation.num_cached_tokens if reservation else request.num_cached_tokens
            handoff = {"transferred": False, "num_cached_tokens": cached}
            return lent, KVTransferParams(handoff=handoff).to_wire()
        handoff = handoff_report(load, request, self.metrics)
        return lent, KVTransferParams(handoff=handoff).to_wire()

    # ---- prefill side -----------------------------------------------------------------
    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, step: StepKVInfo) -> None:
        self.pusher.save(layer_idx, step)

    def wait_for_save(self) -> None:
        self.pusher.wait()

    def _prefill_finished(
        self, request: ConnectorRequest, block_ids: list[int], params: KVTransferParams, prefix: Load | None
    ) -> tuple[bool, dict | None]:
        done_at = time.time()
        address = self.kv_address()
        if params.mode(self.config.mode) == "push":
            sources = prefill_prompt_sources(request, params, prefix, self.block_size)
            keep, pushed = push_finished(self.pusher, self.metrics, request, block_ids, sources, done_at)
            return keep, pushed.with_address(address).to_wire()
        if request.finish_reason not in ("stop", "length") or not block_ids:
            return False, None
        self.holds.hold(request.request_id, block_ids, request.prompt_kv_hashes())
        held = KVTransferParams(
            do_remote_prefill=True,
            transfer_mode="pull",
            remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=request.num_prompt_tokens,
            prompt_token_ids=tuple(request.prompt_token_ids),
            prefill_done_at=done_at,
        )
        return True, held.with_address(address).to_wire()

    def release_hold(self, request_id: str) -> bool:
        """Prefill, pull mode: free a hold nobody will read (the proxy's request ended
        first). Reads already under way for it are the aborted request's, so they may see
        the blocks reused."""
        return self.holds.release(request_id, "unread")

    def _on_hold_released(self, request_id: str, how: str) -> None:
        with self._lock:
            self._freeable.add(request_id)
        if how == "expired":
            self.metrics.reservations_expired.inc()
        elif how == "unread":
            self.metrics.transfers.labels("prefill", "released_unread").inc()
        else:
            self.metrics.transfers.labels("prefill", "ok").inc()
        self._wake()

    def _on_parked_end(self, request_id: str) -> None:
        with self._lock:
            self._freeable.add(request_id)
        self._wake()

    def shutdown(self) -> None:
        self.pusher.close()
        self.holds.clear()
        self.lends.clear()
        self.transport.close()
