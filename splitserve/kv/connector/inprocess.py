"""An in-process KV connector: a prefill-only and a decode-only engine in one process
share an `InProcessKVStore`. It exercises the whole connector seam without a transport.

Prefill side: a request with `do_remote_decode` gets a store entry at allocation (its
prefix-cache hit is copied from the cache), then each layer's freshly computed KV is
copied in from `save_kv_layer`; `request_finished` returns the kv_transfer_params that
send the request to a decode engine. Decode side: a request with `do_remote_prefill`
loads the common prefix of the stored prompt and its own, at most n - 1 tokens,
synchronously in `start_load_kv` or (load_async=True) from a background thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.kv.connector.base import ConnectorRequest, KVConnector, StepKVInfo
from splitserve.protocol.kv_transfer import KVTransferParams

logger = logging.getLogger(__name__)


class _Entry(NamedTuple):
    prompt_token_ids: list[int]
    kv: torch.Tensor  # [layers, 2, num_tokens, kv_heads, head_dim]


class _Load(NamedTuple):
    request_id: str
    entry_id: str
    block_ids: list[int]
    start: int  # first position to load
    num_tokens: int


class InProcessKVStore:
    """KV of finished prefills, keyed by the prefill request ID."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def put(self, key: str, entry: _Entry) -> None:
        with self._lock:
            self._entries[key] = entry

    def get(self, key: str) -> _Entry | None:
        with self._lock:
            return self._entries.get(key)

    def pop(self, key: str) -> _Entry | None:
        with self._lock:
            return self._entries.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class InProcessConnector(KVConnector):
    def __init__(
        self, store: InProcessKVStore, engine_id: str = "inprocess", load_async: bool = False
    ) -> None:
        self.store = store
        self.engine_id = engine_id
        self.load_async = load_async
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self._wakeup: Callable[[], None] = lambda: None
        self._saving: dict[str, torch.Tensor] = {}  # request ID -> KV being filled
        self._pending_loads: list[_Load] = []
        self._lock = threading.Lock()
        self._finished_loading: set[str] = set()
        self._failed_loading: set[str] = set()
        self._loading: set[str] = set()  # async loads in flight
        self._orphaned: set[str] = set()  # finished (aborted) while loading: blocks held
        self._releasable: set[str] = set()  # orphans whose load ended: blocks may be freed
        self.num_saved_layers = 0  # save_kv_layer calls that copied something (tests)

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        self.kv_cache, self.block_size = kv_cache, block_size

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def _slots(self, block_ids: list[int], start: int, num_tokens: int) -> torch.Tensor:
        assert self.kv_cache is not None
        positions = torch.arange(start, start + num_tokens)
        table = torch.tensor(block_ids, dtype=torch.long)
        return (table[positions // self.block_size] * self.block_size + positions % self.block_size).to(
            self.kv_cache.device
        )

    def _flat(self) -> torch.Tensor:  # [layers, 2, num_slots, kv_heads, head_dim]
        assert self.kv_cache is not None
        return self.kv_cache.flatten(2, 3)

    # ---- scheduler half -----------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params.do_remote_prefill:
            return 0, False
        entry = self.store.get(str(params.remote_request_id))
        if entry is None:
            return 0, False
        common = 0
        for mine, theirs in zip(request.prompt_token_ids, entry.prompt_token_ids, strict=False):
            if mine != theirs:
                break
            common += 1
        loadable = min(common, request.num_prompt_tokens - 1) - num_computed_tokens
        return max(loadable, 0), self.load_async and loadable > 0

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params.do_remote_decode:
            assert self.kv_cache is not None
            layers, _, _, _, kv_heads, head_dim = self.kv_cache.shape
            kv = self.kv_cache.new_zeros((layers, 2, request.num_prompt_tokens, kv_heads, head_dim))
            hit = request.num_computed_tokens
            if hit:
                kv[:, :, :hit] = self._flat()[:, :, self._slots(block_ids, 0, hit)]
            self._saving[request.request_id] = kv
        if num_external_tokens > 0:
            load = _Load(
                request.request_id,
                str(params.remote_request_id),
                list(block_ids),
                request.num_computed_tokens,
                num_external_tokens,
            )
            if self.load_async:
                with self._lock:
                    self._loading.add(request.request_id)
                threading.Thread(target=self._load_in_background, args=(load,), daemon=True).start()
            else:
                self._pending_loads.append(load)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        with self._lock:
            if request.request_id in self._loading:  # the loader still writes into its blocks
                self._orphaned.add(request.request_id)
                return True, None
        if params.do_remote_prefill:  # consumed, or not needed (nothing to load)
            self.store.pop(str(params.remote_request_id))
        kv = self._saving.pop(request.request_id, None)
        if kv is None or request.finish_reason in ("abort", "error"):
            return False, None
        self.store.put(request.request_id, _Entry(list(request.prompt_token_ids), kv))
        held = KVTransferParams(
            do_remote_prefill=True,
            transfer_mode="pull",
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=request.num_prompt_tokens,
            prompt_token_ids=tuple(request.prompt_token_ids),
        )
        return False, held.to_wire()

    def get_finished_loading(self) -> set[str]:
        with self._lock:
            done, self._finished_loading = self._finished_loading, set()
        return done

    # ---- worker half --------------------------------------------------------------
    def _copy_in(self, load: _Load) -> None:
        entry = self.store.get(load.entry_id)
        if entry is None:
            raise KeyError(f"KV for {load.entry_id} is no longer in the store")
        source = entry.kv[:, :, load.start : load.start + load.num_tokens]
        self._flat()[:, :, self._slots(load.block_ids, load.start, load.num_tokens)] = source

    def get_finished_sending(self) -> set[str]:
        with self._lock:
            done, self._releasable = self._releasable, set()
        return done

    def get_failed_loading(self) -> set[str]:
        with self._lock:
            failed, self._failed_loading = self._failed_loading, set()
        return failed

    def _load_in_background(self, load: _Load) -> None:
        try:
            self._copy_in(load)
            ok = True
        except Exception:
            logger.exception("in-process KV load for %s failed; it will be recomputed", load.request_id)
            ok = False
        with self._lock:
            self._loading.discard(load.request_id)
            if load.request_id in self._orphaned:
                self._orphaned.discard(load.request_id)
                self._releasable.add(load.request_id)
                self.store.pop(load.entry_id)
            elif ok:
                self._finished_loading.add(load.request_id)
            else:
                self._failed_loading.add(load.request_id)
        self._wakeup()

    def start_load_kv(self, step: StepKVInfo) -> None:
        loads, self._pending_loads = self._pending_loads, []
        for load in loads:
            self._copy_in(load)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, step: StepKVInfo) -> None:
        flat = kv_layer.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
        for slots in step.requests:
            kv = self._saving.get(slots.request_id)
            if kv is None:
                continue
            end = min(slots.position_start + slots.num_tokens, kv.shape[2])
            count = end - slots.position_start
            if count <= 0:
                continue
            rows = step.slot_mapping[slots.token_start : slots.token_start + count]
            kv[layer_idx, :, slots.position_start : end] = flat[:, rows]
            self.num_saved_layers += 1
