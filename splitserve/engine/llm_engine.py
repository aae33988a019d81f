"""The synchronous token-in/token-out engine: add requests, call step(), read outputs.

A step is schedule -> runner.execute -> scheduler.update_from_output, then the outputs of
the requests it touched. The model runner loads the model and sizes the KV pool; the
scheduler admits, preempts and finishes requests.

Not thread-safe: one thread drives it (AsyncEngine runs it in a background thread).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from splitserve.config import EngineConfig
from splitserve.encoder_cache.connector import ECConnector
from splitserve.engine.block_manager import BlockManager, cdiv
from splitserve.engine.kv_store_client import KVStoreClient
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.multimodal import MultiModalInputs
from splitserve.engine.outputs import EngineStats, RequestOutput, StepShape
from splitserve.engine.request import Request, ScheduledRequest
from splitserve.engine.scheduler import Scheduler
from splitserve.gguf_file import shared_gguf_readers
from splitserve.kv.connector.base import KVCacheAllocator, KVConnector
from splitserve.protocol.errors import InvalidRequestError, PromptTooLongError
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_events import AllBlocksCleared
from splitserve.protocol.multimodal import ImageInput
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.runtime.kv_events import KVEventPublisher
from splitserve.runtime.thread_wait import ThreadWait

logger = logging.getLogger(__name__)
RECENT_STEPS = 64  # steps `stats()` lists: more than run while a probe reads its answer and then the stats


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        ec_connector: ECConnector | None = None,  # visual embeddings from encoder workers
        kv_store: KVStoreClient | None = None,  # the KV store tier: offloads, loads into the prefix cache
    ) -> None:
        self.config = config
        self.connector = connector
        self.kv_store = kv_store
        self.ec_connector = ec_connector
        with shared_gguf_readers():  # a GGUF file's metadata parsed once, not per part read
            self.runner = runner = ModelRunner(config, connector, kv_cache_allocator, ec_connector)
        # what callers read of the loaded model, held by the runner
        self.model_info, self.model, self.multimodal = runner.model_info, runner.model, runner.multimodal
        self.device, self.dtype, self.kv_cache = runner.device, runner.dtype, runner.kv_cache
        self.block_manager = BlockManager(
            runner.num_blocks,
            runner.block_size,
            # a hybrid model's hit needs a Mamba state snapshot as of its end (state_pool.py)
            config.cache.enable_prefix_caching
            and (runner.state_pool is None or runner.state_pool.snapshots is not None),
            record_events=config.kv_events is not None,
            medium="GPU" if self.device.type == "cuda" else "CPU",
            retention_ttl_s=config.cache.retention_ttl_s,
        )
        if runner.state_pool is not None:
            runner.state_pool.announce_hits_in(self.block_manager)
        if kv_store is not None:
            if not self.block_manager.enable_prefix_caching or runner.state_pool is not None:
                kv_store.shutdown()
                raise ValueError(
                    "--kv-store needs the prefix cache, and a model without Mamba state (hybrid "
                    "models' state is not stored)"
                )
            self.block_manager.observer = kv_store  # it offloads the blocks the prefix cache evicts
            kv_store.register_kv_cache(self.kv_cache, runner.block_size)
        self.kv_event_publisher = KVEventPublisher(config.kv_events) if config.kv_events else None
        if self.kv_event_publisher is not None:
            # a (re)started engine holds nothing: indexers drop what an earlier instance held
            self.kv_event_publisher.publish([AllBlocksCleared()])
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            self.model_info.max_model_len,
            connector,
            runner.state_pool,
            kv_store,
        )
        if connector is not None:
            connector.register_kv_cache(self.kv_cache, runner.block_size)
        self.pending_outputs: list[RequestOutput] = []
        self.last_step_time_s = 0.0
        # the engine thread's CPU time in steps: a one-thread engine's process CPU beyond it
        # is its API's (the tiers' share `sim calibrate --proxy` measures)
        self.step_thread_cpu_s = 0.0
        # and its wait for a core in steps: what the processes beside it took from them
        self.step_thread_wait_s = 0.0
        self.step_wait = ThreadWait()
        self.last_step_tokens = 0
        self.last_step_shape = StepShape()
        # the last steps' (tokens, seconds): `sim calibrate` reads a prompt's step beside
        # decodes from it, the step itself rather than a difference of counters
        self.recent_steps: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)
        self.num_steps = 0  # steps that ran the model
        self.eos_token_ids = frozenset(self.model_info.eos_token_ids)

    # ---- requests -----------------------------------------------------------------
    def validate_request(self, request: GenerateRequest) -> MultiModalInputs | None:
        """Raise InvalidRequestError / PromptTooLongError; reads only immutable state.
        The wire checks are `GenerateRequest.from_wire`'s; these need the model. Returns
        the request's images checked against its prompt, for `add_validated_request`."""
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if not isinstance(request.sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
        prompt_token_ids = request.token_ids
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise InvalidRequestError("token_ids must be a non-empty list of integers", param="token_ids")
        vocab = self.model_info.vocab_size
        for token in prompt_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"token_ids must be integers in [0, {vocab}); got {token!r}", param="token_ids"
                )
        n = len(prompt_token_ids)
        if n >= self.model_info.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; the maximum context length is {self.model_info.max_model_len} "
                "(prompt plus at least one generated token)",
                param="token_ids",
            )
        if cdiv(n + 1, self.block_manager.block_size) > self.block_manager.num_blocks:
            raise PromptTooLongError(
                f"prompt has {n} tokens; the KV cache holds at most "
                f"{self.block_manager.num_blocks * self.block_manager.block_size - 1}",
                param="token_ids",
            )
        if request.cache_salt is not None and not isinstance(request.cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
        return self._multimodal_inputs(list(prompt_token_ids), list(request.images))

    def add_request(self, request: GenerateRequest, *, arrival_time: float | None = None) -> None:
        multimodal = self.validate_request(request)
        self.add_validated_request(request, multimodal, arrival_time=arrival_time)

    def add_validated_request(
        self,
        request: GenerateRequest,
        multimodal: MultiModalInputs | None,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """`add_request` for a request `validate_request` has accepted, with what it
        returned (the async engine validates on the caller's thread; its engine thread
        does not validate again)."""
        if self.scheduler.request_id_in_use(request.request_id):
            raise InvalidRequestError(
                f"request_id {request.request_id!r} is already in use", param="request_id"
            )
        sampling_params = request.sampling_params.for_context(
            len(request.token_ids), self.model_info.max_model_len
        )
        if self.config.role == "prefill":
            sampling_params = dataclasses.replace(sampling_params, max_tokens=1)
        self.scheduler.add(
            Request(
                dataclasses.replace(request, sampling_params=sampling_params),
                eos_token_ids=self.eos_token_ids,
                block_size=self.block_manager.block_size,
                arrival_time=arrival_time,
                multimodal=multimodal,
            )
        )

    def _multimodal_inputs(
        self, prompt: list[int], images: list[ImageInput] | None
    ) -> MultiModalInputs | None:
        """The request's images checked against its prompt (None for a text-only prompt)."""
        if self.multimodal is None:
            if images:
                raise InvalidRequestError("this model takes no images", param="images")
            return None
        return self.multimodal.request_inputs(prompt, images or [])

    def abort_request(self, request_ids: str | list[str]) -> list[str]:
        """Abort requests; returns the IDs that were found. Their final outputs
        (finish_reason "abort") come out of the next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        found = []
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            found.append(request_id)
            self.scheduler.finish_request(request, "abort")
            self.pending_outputs.append(request_output(request))
        return found

    def take_pending_outputs(self) -> list[RequestOutput]:
        """The final outputs of aborted requests, now rather than at the next step()."""
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests) or bool(self.pending_outputs)

    def has_runnable_work(self) -> bool:
        """False when every unfinished request waits for remote KV (nothing to compute).
        Polls the connector first: a finished async load makes its request runnable now."""
        self.poll_connector()
        return self.scheduler.has_runnable() or bool(self.pending_outputs)

    # ---- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.block_manager.take_events())
        return outputs

    def _step(self) -> list[RequestOutput]:
        self.block_manager.evict_expired()
        outputs, self.pending_outputs = self.pending_outputs, []
        self.poll_connector()
        start, cpu_start = time.perf_counter(), time.thread_time()
        wait_start = self.step_wait.seconds()
        scheduler_output = self.scheduler.schedule()
        outputs.extend(request_output(request) for request in scheduler_output.too_long)
        if not scheduler_output.scheduled:
            return outputs
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception:
            logger.exception(
                "engine step failed; failing the %d requests in it", len(scheduler_output.scheduled)
            )
            for item in scheduler_output.scheduled:
                self.scheduler.finish_request(item.request, "error")
                outputs.append(request_output(item.request))
            return outputs
        self.scheduler.update_from_output(scheduler_output, runner_output)
        for sampled in runner_output.sampled:
            logprobs = [sampled.logprobs] if sampled.logprobs else None
            outputs.append(request_output(sampled.request, [sampled.token_id], logprobs))
        self.last_step_time_s = time.perf_counter() - start
        self.step_thread_cpu_s += time.thread_time() - cpu_start
        if wait_start is not None and (wait_end := self.step_wait.seconds()) is not None:
            self.step_thread_wait_s += wait_end - wait_start
        self.last_step_tokens = scheduler_output.num_tokens
        self.last_step_shape = step_shape(scheduler_output.scheduled)
        self.recent_steps.append((self.last_step_tokens, self.last_step_time_s))
        self.num_steps += 1
        return outputs

    def poll_connector(self) -> None:
        """Pick up finished/failed async loads and releasable blocks (step() does this too)."""
        self.scheduler.poll_connector()

    def fail_all_requests(self) -> list[RequestOutput]:
        """Finish every unfinished request with "error" (after an unexpected failure)."""
        outputs = []
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish_request(request, "error")
            outputs.append(request_output(request))
        return outputs

    # ---- introspection ------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        prefilling = [r for r in sched.running if r.num_computed_tokens < r.num_tokens - 1]
        decoding = [r for r in sched.running if r.num_computed_tokens >= r.num_tokens - 1]
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.waiting_for_remote) + len(sched.waiting_for_store),
            kv_usage=bm.usage,
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            prefix_cache_queried_tokens=sched.prefix_queried_tokens,
            prefix_cache_hit_tokens=sched.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
            last_step_time_s=self.last_step_time_s,
            last_step_tokens=self.last_step_tokens,
            num_waiting_prefill_tokens=sum(
                r.num_tokens - max(r.num_computed_tokens, r.num_cached_on_arrival) for r in sched.waiting
            )
            + sum(r.num_tokens - r.num_computed_tokens for r in prefilling),
            num_running_decode_blocks=sum(len(r.block_ids) for r in decoding),
            num_borrowed_cpu_steps=self.runner.step_threads.borrowed_steps,
            last_step_borrowed=bool(self.runner.step_threads.borrowed),
            num_threads=self.runner.step_threads.parallel_threads,
            step_thread_cpu_s=self.step_thread_cpu_s,
            step_thread_wait_s=self.step_thread_wait_s,
            long_prefill_token_threshold=sched.config.long_prefill_token_threshold,
            recent_steps=tuple(self.recent_steps),
            last_step_shape=self.last_step_shape,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        if self.kv_store is not None:
            self.kv_store.shutdown()
        if self.ec_connector is not None:
            self.ec_connector.shutdown()
        if self.runner.ffn is not None:
            self.runner.ffn.close()


def step_shape(scheduled: list[ScheduledRequest]) -> StepShape:
    """A step's work as the simulator prices it: a sequence computing one token decodes
    (a decode worker's first step computes the prompt's last token, one token all the same)."""
    decodes = [s for s in scheduled if s.num_tokens == 1]
    chunks = tuple((s.num_tokens, s.position_start) for s in scheduled if s.num_tokens > 1)
    return StepShape(len(decodes), sum(s.position_start for s in decodes), chunks)


def request_output(
    request: Request, new_token_ids: list[int] | None = None, new_logprobs: list[dict] | None = None
) -> RequestOutput:
    """The request's output for this step: its new tokens and its state now."""
    if request.sampling_params.logprobs is None:
        new_logprobs = None
    elif new_logprobs is None:
        new_logprobs = []
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids or [],
        new_logprobs=new_logprobs,
        finished=request.is_finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        kv_transfer_params=request.output_kv_transfer_params,
        metrics=dict(request.metrics),
    )
