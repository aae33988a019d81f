"""Prefill side of push mode: ship each request's finished blocks layer by layer.

`save` runs from the model's forward right after layer i wrote its KV; it queues the
blocks that are complete for that layer (the destination peer's send lane copies them
while layer i+1 computes). A block is sent once per layer: when its positions are all computed,
or when the prompt ends inside it. Prefix-cached blocks of prefill go with the first chunk.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.kv.block_hash import cdiv
from splitserve.kv.connector import StepKVInfo
from splitserve.kv.transport import KVTransport
from splitserve.kv.transport_types import PeerInfo, TransferError
from splitserve.protocol.kv_transfer import KVParamsError, KVTransferParams

logger = logging.getLogger(__name__)


@dataclass
class _PushPlan:
    peer: PeerInfo
    transfer_id: str
    dst: list[int]  # decode's blocks, for our blocks first_block, first_block + 1, ...
    first_block: int
    num_tokens: int  # the decode side needs positions [0, num_tokens - 1)
    next_block: int  # first block not yet sent for every layer
    block_hashes: list[str]  # the prompt's KV hashes (Request.prompt_kv_hashes), by our block index
    error: str | None = None


class PushOutcome(NamedTuple):
    peer: PeerInfo
    transfer_id: str
    error: str | None
    send_s: float  # time the sender spent copying this request's KV
    num_bytes: int


class LayerPusher:
    def __init__(self, transport: KVTransport, timeout_s: float):
        self.transport = transport
        self.timeout_s = timeout_s
        self.block_size = 0
        self.num_layers = 0
        self._plans: dict[str, _PushPlan] = {}
        self._pushed_this_step = False

    def plan(
        self, request_id: str, num_prompt_tokens: int, params: KVTransferParams, block_hashes: list[str]
    ) -> None:
        """Remember where a request's blocks go (idempotent: admission may be retried)."""
        if request_id in self._plans:
            return
        try:
            peer = PeerInfo(*params.remote_address())
            dst = list(params.block_ids())
        except KVParamsError as exc:
            logger.warning("request %s cannot push its KV: %s", request_id, exc)
            return
        first = params.remote_first_block or 0
        transfer_id = params.remote_request_id or request_id
        plan = _PushPlan(peer, transfer_id, dst, first, num_prompt_tokens, first, block_hashes)
        needed_blocks = cdiv(num_prompt_tokens - 1, self.block_size) - first
        if needed_blocks != len(dst):
            plan.error = (
                f"decode reserved {len(dst)} blocks, the prompt needs {needed_blocks} from block {first}"
            )
            self.transport.send_failure(peer, transfer_id, plan.error)
        self._plans[request_id] = plan

    def save(self, layer_idx: int, step: StepKVInfo) -> None:
        if not self._plans:
            return
        ready_at = time.time()
        for slots in step.requests:
            plan = self._plans.get(slots.request_id)
            if plan is None or plan.error is not None:
                continue
            computed_end = slots.position_start + slots.num_tokens
            needed = plan.num_tokens - 1
            last = plan.first_block + len(plan.dst)
            ready = plan.next_block
            while ready < last and computed_end >= min((ready + 1) * self.block_size, needed):
                ready += 1
            if ready == plan.next_block:
                continue
            src = slots.block_ids[plan.next_block : ready]
            dst = plan.dst[plan.next_block - plan.first_block : ready - plan.first_block]
            try:
                hashes = plan.block_hashes[plan.next_block : ready]
                self.transport.push_layer(plan.peer, plan.transfer_id, layer_idx, src, dst, ready_at, hashes)
            except TransferError as exc:
                plan.error = str(exc)
                continue
            self._pushed_this_step = True
            if layer_idx == self.num_layers - 1:
                plan.next_block = ready

    def wait(self) -> None:
        """After the last layer: the step's blocks must be out before they can be freed."""
        if not self._pushed_this_step:
            return
        self._pushed_this_step = False
        late = self.transport.flush_peers(self.timeout_s)
        for plan in self._plans.values():
            if plan.peer in late:  # only the requests bound for a late peer fail
                plan.error = plan.error or f"KV send did not finish within {self.timeout_s:.1f}s"

    def finish(self, request_id: str, finish_reason: str | None) -> PushOutcome | None:
        """The request ended: how its push went. A push left incomplete is reported to decode
        at once, so it recomputes instead of waiting for the timeout."""
        plan = self._plans.pop(request_id, None)
        if plan is None:
            return None
        seconds, num_bytes = self.transport.take_send_stats(plan.transfer_id)
        error = plan.error or self.transport.take_send_error(plan.transfer_id)
        if error is None and plan.next_block < plan.first_block + len(plan.dst):
            error = f"prefill ended ({finish_reason}) before its KV was sent"
        if error is not None:
            self.transport.send_failure(plan.peer, plan.transfer_id, error)
        return PushOutcome(plan.peer, plan.transfer_id, error, seconds, num_bytes)
