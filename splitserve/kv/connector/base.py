"""The KV connector seam: how an engine loads KV computed elsewhere and ships its own.

One `KVConnector` object per engine holds both halves (vLLM V1 style split, one process):
the *scheduler half* decides which requests load or save what; the *worker half* moves the
bytes and is called from inside the model's forward pass, layer by layer.

Exact call order, all on the engine thread unless noted:

At engine start:
  1. `kv_cache_allocator()` — may return an allocator for the KV cache tensor (e.g. one
     backed by a shared-memory file); None means `torch.zeros`.
  2. `register_kv_cache(kv_cache, block_size)` — the engine's one KV tensor, shaped
     [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; block IDs index dim 2.
  3. `set_wakeup(fn)` — `fn()` is thread-safe; call it when an async load completes
     (or fails) so an idle engine loop wakes at once instead of at its next poll.
  A hybrid (attention + Mamba) model first calls `register_state(state_bytes)`: every
  transfer then also carries the request's Mamba state as of position n - 1, whole.

Each step, scheduling (for each WAITING request being admitted):
  4. `get_num_new_matched_tokens(request, num_computed_tokens)` ->
     (num_external_tokens, load_async). `num_computed_tokens` is the local prefix-cache
     hit. The engine never asks for the last prompt token: it is always recomputed, so a
     decode engine loads positions [hit, n - 1) of an n-token prompt at most (the
     connector must return at most n - 1 - num_computed_tokens).
  5. `update_state_after_alloc(request, block_ids, num_external_tokens)` — blocks are
     allocated for the hit + external tokens (+ this step's new tokens when the load is
     synchronous). The external tokens go to positions [num_computed_tokens,
     num_computed_tokens + num_external_tokens), i.e. into `block_ids` by position.
     With load_async the request parks in WAITING_FOR_REMOTE_KVS holding its blocks.

Each step, forward pass (only when the step computes tokens):
  6. `start_load_kv(step)` — begin the synchronous loads registered in step 5.
  7. for each layer i: `wait_for_layer_load(i)`; the layer's attention writes its KV into
     the cache; `save_kv_layer(i, kv_cache[i], step)` — ship layer i while i+1 computes.
  8. (hybrid) `save_state(request_id, state)` for each request whose step reached its
     prompt's position n - 1: the Mamba state there. Then `wait_for_save()` — after the
     last layer, before sampling.

After each step:
  9. `get_finished_loading()` / `get_failed_loading()` — request IDs whose async loads are
     complete / failed. Completed ones become WAITING with their external tokens counted
     as computed (they run at the next step); failed ones recompute from their local hit.
     (hybrid) A completed load's Mamba state is `take_received_state(request_id)`; none
     there makes it a failed one.
 10. `request_finished(request, block_ids)` when a request finishes for any reason (its
     finish_reason says which) -> (delay_free_blocks, kv_transfer_params). With
     delay_free_blocks the engine keeps the blocks until the ID shows up in
     `get_finished_sending()`. kv_transfer_params goes into the request's final output.
     A request aborted while its async load is in flight must get delay_free_blocks
     (its blocks cannot be reused while bytes may still land in them); report it from
     `get_finished_sending()` once the load can no longer write.

Role semantics (engine side): a "prefill" engine runs the prompt with max_tokens forced
to 1 and returns `request_finished`'s kv_transfer_params in the finished output; a
"decode" engine given `do_remote_prefill` loads [0, n - 1) via steps 4-9 and computes the
last prompt token itself, exactly like a full prefix-cache hit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from splitserve.protocol.block_hash import BlockHash
from splitserve.protocol.kv_transfer import KVTransferParams

if TYPE_CHECKING:
    import torch

KVCacheAllocator = Callable[..., "torch.Tensor"]  # (shape, *, dtype, device) -> zero-filled tensor


class ConnectorRequest(Protocol):
    """What a connector reads and writes of an engine request (engine.request.Request is
    one): the kv package depends on this shape, not on the engine package."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: KVTransferParams  # parsed at the engine's edge (empty: no transfer)
    num_computed_tokens: int
    num_cached_tokens: int
    block_hashes: list[BlockHash]  # the chained hashes of the request's full blocks
    finish_reason: str | None
    metrics: dict[str, float | None]

    @property
    def num_prompt_tokens(self) -> int: ...

    def prompt_kv_hashes(self) -> list[str]: ...


class RequestSlots(NamedTuple):
    """One request's share of a forward step."""

    request_id: str
    token_start: int  # offset of its first token in the step's flattened tokens
    num_tokens: int  # tokens computed for it in this step
    position_start: int  # prompt position of its first token (= computed tokens before the step)
    block_ids: list[int]  # all its blocks, by position


class StepKVInfo(NamedTuple):
    """Where a step's tokens' KV goes: `slot_mapping[t] = block_id * block_size + offset`."""

    requests: list[RequestSlots]
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the cache's device
    block_size: int


class KVConnector(ABC):
    # ---- set-up -------------------------------------------------------------------
    def kv_cache_allocator(self) -> KVCacheAllocator | None:
        return None

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:  # noqa: B027
        """Called once with the engine's KV cache tensor."""

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:  # noqa: B027
        """Called once; store `wakeup` and call it when async loads complete."""

    def register_state(self, state_bytes: int) -> None:
        """A hybrid model: one request's Mamba state is `state_bytes` long, and travels
        with its KV. A connector that cannot move it raises ValueError (a start-up error)."""
        raise ValueError(f"the {type(self).__name__} cannot hand over a hybrid model's Mamba state")

    # ---- scheduler half -----------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens loadable beyond `num_computed_tokens`, whether the load is async)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's blocks are allocated; remember where its external tokens go."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(delay_free_blocks, kv_transfer_params for the final output)."""

    def get_finished_loading(self) -> set[str]:
        """IDs of requests whose async loads completed since the last call."""
        return set()

    def get_failed_loading(self) -> set[str]:
        """IDs of requests whose async loads failed since the last call (they recompute)."""
        return set()

    def get_finished_sending(self) -> set[str]:
        """IDs of finished requests whose delayed blocks may now be freed."""
        return set()

    def take_received_state(self, request_id: str) -> bytes | None:
        """The Mamba state that arrived with a finished load (hybrid models), once."""
        return None

    # ---- worker half --------------------------------------------------------------
    def uses_layer_hooks(self, step: StepKVInfo) -> bool:
        """Whether this step's forward must call wait_for_layer_load and save_kv_layer per
        layer (a query, no side effects). A step without them runs its layers in one
        compiled call (model/compiled_layers.py), so a connector whose hooks do nothing
        says False."""
        return True

    def start_load_kv(self, step: StepKVInfo) -> None:  # noqa: B027
        """Begin this step's synchronous loads."""

    def wait_for_layer_load(self, layer_idx: int) -> None:  # noqa: B027
        """Block until layer `layer_idx`'s loaded KV is in the cache."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, step: StepKVInfo) -> None:  # noqa: B027
        """Layer `layer_idx`'s KV for this step's tokens has just been written into
        `kv_layer` ([2, num_blocks, block_size, num_kv_heads, head_dim])."""

    def save_state(self, request_id: str, state: bytes) -> None:  # noqa: B027
        """The request's Mamba state as of its prompt's position n - 1 (hybrid models)."""

    def wait_for_save(self) -> None:  # noqa: B027
        """Block until this step's saves no longer need the cache contents."""

    def shutdown(self) -> None:  # noqa: B027
        """Release threads, sockets and files."""
