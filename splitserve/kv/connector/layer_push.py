"""Prefill side of push mode: ship each request's finished blocks layer by layer.

`save` runs from the model's forward right after layer i wrote its KV; it queues the
blocks that are complete for that layer (the destination peer's send lane copies them
while layer i+1 computes). A block is sent once per layer: when its positions are all computed,
or when the prompt ends inside it. Prefix-cached blocks of prefill go with the first chunk.

A hybrid (attention + Mamba) model's request also hands over its Mamba state as of the
prompt's last KV position, whole (`save_state`, after the step that computed it): queued on
the same lane after that step's layers, bound to the prompt's last KV hash. Its push is
complete only with the state.

A request sent with `push_target_pending` computes before decode has reserved anything:
its plan has no destination yet and `save` only records how far each layer got. When the
target arrives (`set_target`, from the HTTP thread) everything computed so far is queued
at once and the rest of the request pushes as usual; a request that finished first is
parked (its blocks kept) until the target comes, is cancelled, or the TTL passes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.kv.connector.base import StepKVInfo
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.types import PeerInfo, TransferError
from splitserve.protocol.block_hash import cdiv
from splitserve.protocol.kv_transfer import KVParamsError, KVTransferParams

logger = logging.getLogger(__name__)


@dataclass
class _PushPlan:
    transfer_id: str
    num_tokens: int  # the decode side needs positions [0, num_tokens - 1)
    block_hashes: list[str]  # the prompt's KV hashes (Request.prompt_kv_hashes), by our block index
    peer: PeerInfo | None = None  # None: the target is pending
    dst: list[int] = field(
        default_factory=list
    )  # decode's blocks, for ours first_block, first_block + 1, ...
    first_block: int = 0
    # first block not yet sent for every layer (target pending: not yet computed for every layer)
    next_block: int = 0
    error: str | None = None
    # target pending: what the current step computed so far, for the catch-up
    src: list[int] = field(default_factory=list)  # our block IDs
    step_end: int = 0  # this step completes our blocks [next_block, step_end) ...
    layers_saved: int = 0  # ... of layers [0, layers_saved) so far
    caught_up: bool = False  # pushes were queued from another thread: flush before freeing
    # a hybrid model: the hash the state is bound to (empty: no state travels), the state
    # computed but not yet queued (target pending), and the bytes queued
    state_hash: str = ""
    state: bytes | None = None
    state_sent: int = 0


class PushOutcome(NamedTuple):
    peer: PeerInfo
    transfer_id: str
    error: str | None
    send_s: float  # time the sender spent copying this request's KV
    num_bytes: int  # KV
    state_bytes: int = 0  # the Mamba state (hybrid models)


class TargetAnswer(NamedTuple):
    """What `set_target` did: "planned" (the request runs on and reports the push in its
    final chunk), "sent" (it had finished: the push is done, `outcome` says how it went)
    or "early" (the request has not been admitted yet: its plan will take the target)."""

    status: str
    outcome: PushOutcome | None = None


class LayerPusher:
    def __init__(self, transport: KVTransport, timeout_s: float, parked_ttl_s: float = 60.0):
        self.transport = transport
        self.timeout_s = timeout_s
        self.parked_ttl_s = parked_ttl_s
        self.block_size = 0
        self.num_layers = 0
        self.carries_state = False  # a hybrid model: every push also hands over the Mamba state
        # the engine thread saves while the HTTP thread sets targets
        self._lock = threading.RLock()
        self._plans: dict[str, _PushPlan] = {}
        self._parked: dict[str, tuple[_PushPlan, threading.Timer]] = {}  # finished, target pending
        self._early: dict[str, tuple[KVTransferParams, float]] = {}  # targets of unadmitted requests
        self._pushed_this_step = False
        self.on_parked_end: Callable[[str], None] = lambda request_id: None  # its blocks may go

    def plan(
        self, request_id: str, num_prompt_tokens: int, params: KVTransferParams, block_hashes: list[str]
    ) -> None:
        """Remember where a request's blocks go (idempotent: admission may be retried)."""
        # the state is as of the prompt's last KV position: bound to the hash of those tokens
        state_hash = block_hashes[-1] if self.carries_state and block_hashes else ""
        with self._lock:
            if request_id in self._plans:
                return
            if params.push_target_pending:
                plan = _PushPlan(params.remote_request_id or request_id, num_prompt_tokens, block_hashes)
                plan.state_hash = state_hash
                self._plans[request_id] = plan
                early = self._early.pop(request_id, None)
                if early is not None:
                    self._target(plan, early[0])
                return
            try:
                peer = PeerInfo(*params.remote_address())
                dst = list(params.block_ids())
            except KVParamsError as exc:
                logger.warning("request %s cannot push its KV: %s", request_id, exc)
                return
            plan = _PushPlan(params.remote_request_id or request_id, num_prompt_tokens, block_hashes)
            plan.state_hash = state_hash
            self._plans[request_id] = plan
            self._aim(plan, peer, dst, params.remote_first_block or 0)
            plan.next_block = plan.first_block

    def _aim(self, plan: _PushPlan, peer: PeerInfo, dst: list[int], first: int) -> None:
        plan.peer, plan.dst, plan.first_block = peer, dst, first
        needed_blocks = cdiv(plan.num_tokens - 1, self.block_size) - first
        if needed_blocks != len(dst):
            plan.error = (
                f"decode reserved {len(dst)} blocks, the prompt needs {needed_blocks} from block {first}"
            )
            self.transport.send_failure(peer, plan.transfer_id, plan.error)

    def _target(self, plan: _PushPlan, params: KVTransferParams) -> None:
        """Under the lock: give a pending plan its target and queue what is computed."""
        try:
            peer = PeerInfo(*params.remote_address())
            dst = list(params.block_ids())
        except KVParamsError as exc:
            plan.error = f"unusable push target: {exc}"
            return
        plan.transfer_id = params.remote_request_id or plan.transfer_id
        computed = plan.next_block  # our blocks [0, computed) hold every layer
        self._aim(plan, peer, dst, params.remote_first_block or 0)
        first = plan.first_block
        plan.next_block = max(first, computed)
        if plan.error is not None:
            return
        for layer in range(self.num_layers):
            end = plan.step_end if layer < plan.layers_saved else computed
            if end > first:
                self._push(plan, layer, first, end, time.time())
        if plan.state is not None:
            self._push_state(plan, time.time())
        plan.caught_up = True
        self._pushed_this_step = True

    def _push(self, plan: _PushPlan, layer: int, start: int, end: int, ready_at: float) -> None:
        """Queue our blocks [start, end) of `layer` for the plan's target."""
        assert plan.peer is not None
        src = plan.src[start:end]
        dst = plan.dst[start - plan.first_block : end - plan.first_block]
        try:
            hashes = plan.block_hashes[start:end]
            self.transport.push_layer(plan.peer, plan.transfer_id, layer, src, dst, ready_at, hashes)
        except TransferError as exc:
            plan.error = str(exc)

    def _push_state(self, plan: _PushPlan, ready_at: float) -> None:
        """Queue the plan's computed state for its target (after the layers queued before)."""
        assert plan.peer is not None and plan.state is not None
        try:
            self.transport.push_state(plan.peer, plan.transfer_id, plan.state, plan.state_hash, ready_at)
            plan.state_sent, plan.state = len(plan.state), None
        except TransferError as exc:
            plan.error = str(exc)

    def save_state(self, request_id: str, state: bytes) -> None:
        """The request's Mamba state as of its prompt's last KV position (a hybrid model),
        computed by the step that just ran: queued now, or kept until the target comes."""
        with self._lock:
            plan = self._plans.get(request_id)
            if plan is None or not plan.state_hash or plan.error is not None:
                return
            plan.state = state
            if plan.peer is not None:
                self._push_state(plan, time.time())
                self._pushed_this_step = True

    def save(self, layer_idx: int, step: StepKVInfo) -> None:
        if not self._plans:
            return
        ready_at = time.time()
        with self._lock:
            for slots in step.requests:
                plan = self._plans.get(slots.request_id)
                if plan is None or plan.error is not None:
                    continue
                computed_end = slots.position_start + slots.num_tokens
                needed = plan.num_tokens - 1
                last = cdiv(needed, self.block_size)
                ready = plan.next_block
                while ready < last and computed_end >= min((ready + 1) * self.block_size, needed):
                    ready += 1
                if ready == plan.next_block:
                    continue
                plan.src = list(slots.block_ids)
                if plan.peer is not None:
                    self._push(plan, layer_idx, plan.next_block, ready, ready_at)
                    self._pushed_this_step = True
                else:
                    plan.step_end, plan.layers_saved = ready, layer_idx + 1
                if layer_idx == self.num_layers - 1:
                    plan.next_block = ready
                    plan.layers_saved = 0

    def wait(self) -> None:
        """After the last layer: the step's blocks must be out before they can be freed."""
        with self._lock:
            if not self._pushed_this_step:
                return
            self._pushed_this_step = False
        late = self.transport.flush_peers(self.timeout_s)
        with self._lock:
            for plan in self._plans.values():
                if plan.peer in late:  # only the requests bound for a late peer fail
                    plan.error = plan.error or f"KV send did not finish within {self.timeout_s:.1f}s"

    def park(self, request_id: str, finish_reason: str | None, block_ids: list[int]) -> bool:
        """The request finished with its target still pending: keep its blocks (True) until
        `set_target` pushes them, `cancel` or the TTL ends the wait (`on_parked_end`). An
        aborted one is not parked: nobody waits for its KV."""
        with self._lock:
            plan = self._plans.get(request_id)
            if plan is None or plan.peer is not None:
                return False
            del self._plans[request_id]
            if finish_reason not in ("stop", "length") or plan.error is not None:
                return False
            plan.src = list(block_ids)
            timer = threading.Timer(self.parked_ttl_s, self.cancel, args=(request_id,))
            timer.daemon = True
            self._parked[request_id] = (plan, timer)
        timer.start()
        return True

    def set_target(self, request_id: str, params: KVTransferParams) -> TargetAnswer:
        """Where a `push_target_pending` request's KV goes (decode's reservation). Blocks
        while a parked request's push is flushed: call it off the event loop."""
        with self._lock:
            plan = self._plans.get(request_id)
            if plan is not None:
                if plan.peer is None:
                    self._target(plan, params)
                return TargetAnswer("planned")
            parked = self._parked.pop(request_id, None)
            if parked is None:
                now = time.monotonic()
                self._early = {k: v for k, v in self._early.items() if now - v[1] < self.parked_ttl_s}
                self._early[request_id] = (params, now)
                return TargetAnswer("early")
            plan, timer = parked
            timer.cancel()
            plan.layers_saved = 0  # it finished: every computed block holds every layer
            self._target(plan, params)
        try:
            late = self.transport.flush_peers(self.timeout_s)
            if plan.peer in late:
                plan.error = plan.error or f"KV send did not finish within {self.timeout_s:.1f}s"
            return TargetAnswer("sent", self._outcome(plan, "stop"))
        finally:
            self.on_parked_end(request_id)

    def cancel(self, request_id: str) -> bool:
        """Nothing will be pushed for the request (decode reserved nothing, or the wait
        ended): a parked one's blocks go now. True when something was waiting."""
        with self._lock:
            early = self._early.pop(request_id, None)
            plan = self._plans.get(request_id)
            if plan is not None and plan.peer is None:
                plan.error = "the push target was cancelled"
                return True
            parked = self._parked.pop(request_id, None)
        if parked is None:
            return early is not None
        parked[1].cancel()
        self.on_parked_end(request_id)
        return True

    def finish(self, request_id: str, finish_reason: str | None) -> PushOutcome | None:
        """The request ended: how its push went. A push left incomplete is reported to decode
        at once, so it recomputes instead of waiting for the timeout."""
        with self._lock:
            plan = self._plans.pop(request_id, None)
        if plan is None or plan.peer is None:
            return None
        if plan.caught_up:  # pushes queued from the HTTP thread may postdate this step's flush
            late = self.transport.flush_peers(self.timeout_s)
            if plan.peer in late:
                plan.error = plan.error or f"KV send did not finish within {self.timeout_s:.1f}s"
        return self._outcome(plan, finish_reason)

    def _outcome(self, plan: _PushPlan, finish_reason: str | None) -> PushOutcome:
        assert plan.peer is not None
        sent = self.transport.sent.take(plan.transfer_id)
        error = plan.error or self.transport.take_send_error(plan.transfer_id)
        if error is None and plan.next_block < plan.first_block + len(plan.dst):
            error = f"prefill ended ({finish_reason}) before its KV was sent"
        if error is None and plan.state_hash and not plan.state_sent:
            error = f"prefill ended ({finish_reason}) before its Mamba state was sent"
        if error is not None:
            self.transport.send_failure(plan.peer, plan.transfer_id, error)
        return PushOutcome(plan.peer, plan.transfer_id, error, sent.seconds, sent.kv_bytes, sent.state_bytes)

    def close(self) -> None:
        with self._lock:
            timers = [timer for _, timer in self._parked.values()]
            self._parked.clear()
        for timer in timers:
            timer.cancel()
