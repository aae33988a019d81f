"""A request's state inside the engine: tokens so far, KV progress, status, timings."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, NamedTuple

from splitserve.protocol.block_hash import BlockHash, compute_block_hashes, kv_block_hashes
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import KVTransferParams

if TYPE_CHECKING:
    from splitserve.engine.multimodal import MultiModalInputs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks held, async KV load in flight
    WAITING_FOR_STORE = "waiting_for_store"  # blocks held, loading from the KV store tier
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token IDs are prompt + output; `num_computed_tokens` of them have KV in `block_ids`.
    A request whose num_computed_tokens < len(all_token_ids) - 1 is (re)prefilling."""

    def __init__(
        self,
        generate: GenerateRequest,
        *,
        eos_token_ids: frozenset[int],
        block_size: int,
        arrival_time: float | None = None,
        multimodal: MultiModalInputs | None = None,
    ) -> None:
        sampling_params = generate.sampling_params
        if sampling_params.max_tokens is None:
            raise ValueError("max_tokens must be resolved (SamplingParams.for_context) before the engine")
        self.request_id = generate.request_id
        self.multimodal = multimodal  # images: their placements, hashes, M-RoPE positions
        self.prompt_token_ids = list(generate.token_ids)
        self.all_token_ids = list(generate.token_ids)
        self.sampling_params = sampling_params
        self.max_tokens: int = sampling_params.max_tokens
        self.cache_salt = generate.cache_salt
        self.kv_transfer_params = generate.kv_transfer_params or KVTransferParams()
        self.block_size = block_size
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache + remote hits at first scheduling
        # the prefix-cache hit when added: until scheduled, the load report counts only the
        # tokens past it, as the router counts what it sends
        self.num_cached_on_arrival = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.output_kv_transfer_params: dict | None = None
        self.connector_consulted = False  # the KV connector was asked for external tokens
        self.store_consulted = False  # the KV store tier was asked for the blocks past the local hit
        self.pending_external_tokens = 0  # tokens an async KV load is bringing in
        self.metrics: dict[str, float | None] = {
            "arrival_time": arrival_time if arrival_time is not None else time.monotonic(),
            "first_scheduled_time": None,
            "first_token_time": None,
            "last_token_time": None,
            "finished_time": None,
        }
        self.update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        self.block_hashes = compute_block_hashes(
            self.all_token_ids,
            self.block_size,
            cache_salt=self.cache_salt,
            mm_spans=self.multimodal.spans if self.multimodal is not None else (),
            parent_hashes=self.block_hashes,
        )

    def prompt_kv_hashes(self) -> list[str]:
        """Hex hashes of the blocks holding the prompt's KV for a P/D handoff (positions
        [0, prompt - 1), the last block's partial tail included): what a transfer of this
        request's KV is bound to, on both ends."""
        hashes = kv_block_hashes(
            self.prompt_token_ids,
            self.num_prompt_tokens - 1,
            self.block_size,
            self.block_hashes,
            cache_salt=self.cache_salt,
            mm_spans=self.multimodal.spans if self.multimodal is not None else (),
        )
        return [block_hash.hex() for block_hash in hashes]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


class ScheduledRequest(NamedTuple):
    """A request's part of one step (the scheduler's output, the runner's and the state
    pool's input)."""

    request: Request
    position_start: int  # tokens already computed before this step
    num_tokens: int  # tokens computed this step
