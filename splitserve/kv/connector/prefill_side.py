"""The P/D connector of a prefill worker: it computes prompts sent with `do_remote_decode`
and ships their KV, pushed layer by layer into decode's reservation (layer_push.py) or
held for decode to pull; in bidirectional mode it first pulls the prefix decode lends it
(prefix_lend.py). pd_connector.py describes the whole flow."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

from splitserve.config import EngineRole, TransferConfig
from splitserve.kv.connector.base import ConnectorRequest, StepKVInfo
from splitserve.kv.connector.layer_push import LayerPusher
from splitserve.kv.connector.load_table import Arrival
from splitserve.kv.connector.pd_base import PDConnector
from splitserve.kv.connector.pd_loads import Load
from splitserve.kv.connector.prefill_finish import push_finished
from splitserve.kv.connector.prefix_lend import prefill_prompt_sources, pullable_prefix_tokens
from splitserve.kv.connector.reservations import HoldTable
from splitserve.kv.transport.arrivals import TransferResult
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.types import PeerInfo
from splitserve.protocol.kv_transfer import KVTransferParams

if TYPE_CHECKING:
    import torch


class PrefillConnector(PDConnector):
    role: ClassVar[EngineRole] = "prefill"

    def __init__(
        self,
        config: TransferConfig,
        *,
        engine_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: KVTransport | None = None,
    ) -> None:
        # the hold table answers the transport's is_held from the moment it exists
        self.holds = HoldTable(config.reservation_ttl_s, self.on_hold_released)
        super().__init__(config, engine_id=engine_id, host=host, port=port, transport=transport)
        self.pusher = LayerPusher(self.transport, config.timeout_s, config.reservation_ttl_s)
        self.pusher.on_parked_end = self.on_parked_end

    def is_held(self, transfer_id: str, block_ids: list[int], block_hashes: list[str]) -> bool:
        return self.holds.is_held(transfer_id, block_ids, block_hashes)

    def release_transfer(self, transfer_id: str) -> None:
        self.holds.release(transfer_id)

    def gauges(self) -> dict[str, float]:
        return {
            "reservations_active": 0,
            "reserved_blocks": 0,
            "holds_active": self.holds.active(),
            "prefix_lends_active": 0,
        }

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        super().register_kv_cache(kv_cache, block_size)
        self.pusher.block_size, self.pusher.num_layers = self.block_size, self.num_layers

    def register_state(self, state_bytes: int) -> None:
        super().register_state(state_bytes)
        self.pusher.carries_state = state_bytes > 0

    # ---- scheduler half ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Side-effect free (vLLM's contract): it may be asked again for the same request."""
        params = request.kv_transfer_params
        if not params.do_remote_decode or self.state_bytes:
            # a hybrid resumes only from a Mamba state snapshot of its own (its prefix-cache
            # hit): decode's lent prefix has no state with it, so it is recomputed here
            return 0, False
        mode = params.mode(self.config.mode)
        return pullable_prefix_tokens(request, num_computed_tokens, params, self.block_size, mode), True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params.do_remote_decode or params.mode(self.config.mode) != "push":
            return
        self.pusher.plan(request.request_id, request.num_prompt_tokens, params, request.prompt_kv_hashes())
        if num_external_tokens > 0:
            self.pull_prefix(request, block_ids, num_external_tokens, params)

    def pull_prefix(
        self,
        request: ConnectorRequest,
        block_ids: list[int],
        num_external_tokens: int,
        params: KVTransferParams,
    ) -> None:
        """Read decode's lent blocks [our hit, our hit + external) into ours."""
        offer = params.prefix_offer()
        assert offer is not None  # pullable_prefix_tokens found one
        lend_id, lent_ids, _hashes = offer
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self.loads.start(
            request.request_id, Load(lend_id, "prefix", time.monotonic(), num_blocks=last - first)
        )
        request.metrics["pulled_tokens"] = num_external_tokens
        dst = list(block_ids[first:last])
        hashes = [block_hash.hex() for block_hash in request.block_hashes[first:last]]
        ttl_s = self.config.reservation_ttl_s
        self.transport.expect(lend_id, dst, self.prefix_arrived, ttl_s=ttl_s, block_hashes=hashes)
        peer = PeerInfo(*params.remote_address())
        self.transport.pull(peer, lend_id, list(lent_ids[first:last]), dst, hashes)

    def prefix_arrived(self, result: TransferResult) -> None:
        self.report_arrival("prefix_pull", result)

    def settle_arrival(self, arrival: Arrival, result: TransferResult) -> None:
        """Nothing: a prefix pull holds no reservation of ours."""

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if not params.do_remote_decode:
            return False, None
        prefix, in_flight = self.loads.end(request.request_id)
        done_at = time.time()
        address = self.kv_address()
        if params.mode(self.config.mode) == "push":
            sources = prefill_prompt_sources(request, params, prefix, self.block_size)
            if self.state_bytes and sources["offered_blocks"]:
                sources["pull_declined"] = "a hybrid model resumes only from its own Mamba state snapshots"
                self.metrics.fallbacks.labels("hybrid_prefix_recompute").inc()
            keep, pushed = push_finished(self.pusher, self.metrics, request, block_ids, sources, done_at)
            return keep or in_flight, pushed.with_address(address).to_wire()
        if request.finish_reason not in ("stop", "length") or not block_ids:
            return in_flight, None
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

    # ---- worker half ------------------------------------------------------------------
    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, step: StepKVInfo) -> None:
        self.pusher.save(layer_idx, step)

    def save_state(self, request_id: str, state: bytes) -> None:
        self.pusher.save_state(request_id, state)

    def wait_for_save(self) -> None:
        self.pusher.wait()

    # ---- holds (pull mode) ------------------------------------------------------------
    def release_hold(self, request_id: str) -> bool:
        """Free a hold nobody will read (the proxy's request ended first). Reads already
        under way for it are the aborted request's, so they may see the blocks reused."""
        return self.holds.release(request_id, "unread")

    def on_hold_released(self, request_id: str, how: str) -> None:
        self.loads.mark_freeable(request_id)
        if how == "expired":
            self.metrics.reservations_expired.inc()
        elif how == "unread":
            self.metrics.transfers.labels("prefill", "released_unread").inc()
        else:
            self.metrics.transfers.labels("prefill", "ok").inc()
        self.wake()

    def on_parked_end(self, request_id: str) -> None:
        self.loads.mark_freeable(request_id)
        self.wake()

    def shutdown(self) -> None:
        self.pusher.close()
        self.holds.clear()
        super().shutdown()
