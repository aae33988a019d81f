"""The P/D connector of a decode worker: a request sent with `do_remote_prefill` reserves
blocks for the KV it lacks and waits, parked, until a prefill worker has pushed it (or it
has pulled it from prefill's hold); in bidirectional mode the reservation also lends the
prefix this worker already holds (prefix_lend.py). pd_connector.py describes the whole flow.

A hybrid (attention + Mamba) model's transfer also waits for the request's Mamba state as
of position n - 1, pushed whole after the layers; the engine takes it once the load is
done (`take_received_state`). Pull mode has no state to read: such a request recomputes."""

from __future__ import annotations

import logging
import threading
import time
from typing import ClassVar

from splitserve.config import EngineRole, TransferConfig
from splitserve.kv.connector.base import ConnectorRequest, StepKVInfo
from splitserve.kv.connector.load_table import Arrival
from splitserve.kv.connector.pd_base import PDConnector
from splitserve.kv.connector.pd_loads import Load, handoff_report, wall_to_monotonic
from splitserve.kv.connector.prefix_lend import PrefixLends
from splitserve.kv.connector.reservations import Reservation, ReservationTable
from splitserve.kv.transport.arrivals import TransferResult
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.types import PeerInfo
from splitserve.protocol.block_hash import cdiv
from splitserve.protocol.kv_transfer import KVParamsError, KVTransferParams

logger = logging.getLogger(__name__)


class DecodeConnector(PDConnector):
    role: ClassVar[EngineRole] = "decode"

    def __init__(
        self,
        config: TransferConfig,
        *,
        engine_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: KVTransport | None = None,
    ) -> None:
        self.reservations = ReservationTable()
        # the lend table answers the transport's is_held from the moment it exists
        self.lends = PrefixLends(config.reservation_ttl_s, self.on_lend_ended)
        super().__init__(config, engine_id=engine_id, host=host, port=port, transport=transport)
        # hybrid models: the states that arrived, by transfer (a push is named by its
        # request), until the engine takes them (transport threads put, the engine takes)
        self.states_lock = threading.Lock()
        self.received_states: dict[str, bytes] = {}

    def is_held(self, transfer_id: str, block_ids: list[int], block_hashes: list[str]) -> bool:
        return self.lends.is_held(transfer_id, block_ids, block_hashes)

    def uses_layer_hooks(self, step: StepKVInfo) -> bool:
        # pushed and pulled KV lands whole before its request is scheduled (it waits for
        # remote KV until then), and a decode worker sends nothing layer by layer
        return False

    def release_transfer(self, transfer_id: str) -> None:
        self.lends.release(transfer_id)

    def gauges(self) -> dict[str, float]:
        return {
            "reservations_active": self.reservations.active(),
            "reserved_blocks": self.reservations.reserved_blocks(),
            "holds_active": 0,
            "prefix_lends_active": self.lends.active(),
        }

    # ---- scheduler half ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Side-effect free (vLLM's contract): it may be asked again for the same request."""
        params = request.kv_transfer_params
        if not params.do_remote_prefill:
            return 0, False
        external = request.num_prompt_tokens - 1 - num_computed_tokens
        if external <= 0:
            return 0, False
        if params.mode(self.config.mode) == "pull" and self.state_bytes:
            logger.warning("request %s computes its prompt: pull mode has no Mamba state", request.request_id)
            self.metrics.fallbacks.labels("hybrid_pull").inc()
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
        self.loads.start(request_id, load)
        # the grant is bound to this prompt's tokens and salt: KV of anything else is refused;
        # a hybrid's state is bound to every token before it (the last KV hash)
        prompt_hashes = request.prompt_kv_hashes()
        hashes = prompt_hashes[first:last]
        state_hash = prompt_hashes[-1] if self.state_bytes else ""
        ttl_s = self.config.reservation_ttl_s
        self.transport.expect(
            transfer_id, dst, self.kv_arrived, ttl_s=ttl_s, block_hashes=hashes, state_hash=state_hash
        )
        if mode == "push":
            lend = self.lend_prefix(request, block_ids[:first])
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

    def kv_arrived(self, result: TransferResult) -> None:
        if result.ok and result.state is not None:  # kept before the engine can hear of the load
            with self.states_lock:
                self.received_states[result.transfer_id] = result.state
        self.report_arrival("decode", result)

    def take_received_state(self, request_id: str) -> bytes | None:
        with self.states_lock:
            return self.received_states.pop(request_id, None)

    def settle_arrival(self, arrival: Arrival, result: TransferResult) -> None:
        self.reservations.remove(arrival.request_id, expired=not result.ok and result.first_arrival is None)
        if result.ok:  # prefill has pushed, so it is done reading our prefix
            self.lends.release_for(arrival.request_id)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if not params.do_remote_prefill:
            return False, None
        request_id = request.request_id
        self.take_received_state(request_id)  # one never taken (the request ended first) goes
        load, in_flight = self.loads.end(request_id)
        lent = self.loads.wait_for_lend(request_id)  # a prefill worker may still read our prefix
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

    # ---- prefix lends -----------------------------------------------------------------
    def lend_prefix(self, request: ConnectorRequest, blocks: list[int]) -> tuple[str | None, tuple, tuple]:
        """Lease our prefix-cache hit (matched by this request's block hashes) to the
        prefill worker: (lend ID, block IDs, hex hashes) for the reservation."""
        if not blocks:
            return None, (), ()
        self.loads.lend_started(request.request_id)
        self.metrics.prefix_blocks.labels("lent").inc(len(blocks))
        hashes = tuple(h.hex() for h in request.block_hashes[: len(blocks)])
        return self.lends.lend(request.request_id, blocks, hashes), tuple(blocks), hashes

    def on_lend_ended(self, request_id: str, expired: bool) -> None:
        self.loads.lend_ended(request_id)
        self.metrics.prefix_lends.labels("expired" if expired else "ended").inc()
        self.wake()

    def shutdown(self) -> None:
        self.lends.clear()
        super().shutdown()
