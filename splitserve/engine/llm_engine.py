"""The synchronous token-in/token-out engine: add requests, call step(), read outputs.

Not thread-safe: one thread drives it (AsyncEngine runs it in a background thread).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from splitserve.config import EngineConfig
from splitserve.engine.block_manager import BlockManager, cdiv
from splitserve.engine.device import choose_dtype, default_device
from splitserve.engine.model_runner import (
    KVCacheAllocator,
    ModelRunner,
    kv_block_bytes,
    kv_cache_shape,
)
from splitserve.engine.multimodal import EncoderCache, MultiModalInputs, MultiModalRunner
from splitserve.engine.outputs import EngineStats, RequestOutput
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.kv.connector import KVConnector
from splitserve.kv.ec_connector import ECConnector
from splitserve.kv.events import KVEventPublisher
from splitserve.model.decoder import load_model
from splitserve.model.loader import load_decoder_config
from splitserve.model.native import load_cpu_ops
from splitserve.model.qwen2_vl import is_qwen2_vl, load_qwen2_vl, load_qwen2_vl_config
from splitserve.protocol.errors import InvalidRequestError, PromptTooLongError
from splitserve.protocol.kv_events import AllBlocksCleared
from splitserve.protocol.multimodal import ImageInput

logger = logging.getLogger(__name__)


class ModelInfo(NamedTuple):
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    block_size: int
    dtype: str
    device: str


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        ec_connector: ECConnector | None = None,  # visual embeddings from encoder workers
    ) -> None:
        self.config = config
        self.connector = connector
        self.ec_connector = ec_connector
        # a vision-language model: its language model is the decoder the engine pages
        self.vl_config = load_qwen2_vl_config(config.model.model) if is_qwen2_vl(config.model.model) else None
        self.decoder_config = (
            self.vl_config.text if self.vl_config else load_decoder_config(config.model.model)
        )
        dc = self.decoder_config
        self.device = torch.device(config.model.device) if config.model.device else default_device()
        self.dtype = choose_dtype(config.model.dtype, dc.dtype, self.device)
        if self.device.type == "cpu":
            # built and loaded here, before any part says it is healthy: never on a request
            load_cpu_ops()
        block_size = config.cache.block_size
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        num_blocks = config.cache.num_blocks or (
            config.cache.kv_cache_memory_bytes // kv_block_bytes(dc, block_size, self.dtype)
        )
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block")
        max_model_len = min(
            config.scheduler.max_model_len or dc.max_position_embeddings, dc.max_position_embeddings
        )
        self.model_info = ModelInfo(
            vocab_size=dc.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=dc.eos_token_ids,
            num_layers=dc.num_layers,
            block_size=block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
        )
        self.multimodal: MultiModalRunner | None = None
        if self.vl_config is None:
            self.model = load_model(config.model.model, dc, self.dtype, self.device)
        else:
            self.model = load_qwen2_vl(config.model.model, self.vl_config, self.dtype, self.device)
            encoder_cache = EncoderCache(config.cache.encoder_cache_bytes)
            self.multimodal = MultiModalRunner(self.model, encoder_cache, ec_connector)
        self.model.prepare_for_inference()
        allocator = (
            kv_cache_allocator or (connector.kv_cache_allocator() if connector else None) or torch.zeros
        )
        self.kv_cache_allocator = allocator
        self.kv_cache = allocator(
            kv_cache_shape(dc, num_blocks, block_size), dtype=self.dtype, device=self.device
        )
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            config.cache.enable_prefix_caching,
            record_events=config.kv_events is not None,
            medium="GPU" if self.device.type == "cuda" else "CPU",
            retention_ttl_s=config.cache.retention_ttl_s,
        )
        self.kv_event_publisher = KVEventPublisher(config.kv_events) if config.kv_events else None
        if self.kv_event_publisher is not None:
            # a (re)started engine holds nothing: indexers drop what an earlier instance held
            self.kv_event_publisher.publish([AllBlocksCleared()])
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len, connector)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            block_size,
            self.device,
            config.model.seed,
            connector,
            self.multimodal,
            serial_step_tokens=config.model.serial_step_tokens,
        )
        if connector is not None:
            connector.register_kv_cache(self.kv_cache, block_size)
        self.requests: dict[str, Request] = {}
        self.delayed_free: dict[str, Request] = {}  # finished, blocks kept for the connector
        self.pending_outputs: list[RequestOutput] = []
        self.last_step_time_s = 0.0
        self.last_step_tokens = 0
        self.num_steps = 0  # steps that ran the model
        self.eos_token_ids = frozenset(dc.eos_token_ids)

    # ---- requests -----------------------------------------------------------------
    def validate_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """Raise InvalidRequestError / PromptTooLongError; reads only immutable state."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
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
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise InvalidRequestError("kv_transfer_params must be an object", param="kv_transfer_params")
        self._multimodal_inputs(prompt_token_ids, images)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        arrival_time: float | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        self.validate_request(
            request_id, prompt_token_ids, sampling_params, cache_salt, kv_transfer_params, images
        )
        self.add_validated_request(
            request_id,
            prompt_token_ids,
            sampling_params,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            arrival_time=arrival_time,
            images=images,
        )

    def add_validated_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        arrival_time: float | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """`add_request` for a request `validate_request` has accepted (the async engine
        validates on the caller's thread; its engine thread does not validate again)."""
        multimodal = self._multimodal_inputs(list(prompt_token_ids), images)
        if request_id in self.requests or request_id in self.delayed_free:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        if self.config.role == "prefill" and sampling_params.max_tokens != 1:
            sampling_params = dataclasses.replace(sampling_params, max_tokens=1)
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            block_size=self.block_manager.block_size,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            arrival_time=arrival_time,
            multimodal=multimodal,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

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
            request = self.requests.get(request_id)
            if request is None:
                continue
            found.append(request_id)
            self.scheduler.remove(request)
            self.pending_outputs.append(self._finish(request, "abort"))
        return found

    def take_pending_outputs(self) -> list[RequestOutput]:
        """The final outputs of aborted requests, now rather than at the next step()."""
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pending_outputs)

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
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        for request in sched.too_long:
            outputs.append(self._finish(request, "length"))
        if not sched.scheduled:
            return outputs
        now = time.monotonic()
        for item in sched.scheduled:
            if item.request.metrics["first_scheduled_time"] is None:
                item.request.metrics["first_scheduled_time"] = now
        try:
            sampled = self.runner.execute([s for s in sched.scheduled if s.num_tokens > 0])
        except Exception:
            logger.exception("engine step failed; failing the %d requests in it", len(sched.scheduled))
            outputs.extend(self._fail_step(sched))
            return outputs
        for item in sched.scheduled:
            item.request.num_computed_tokens += item.num_tokens
            self.block_manager.cache_full_blocks(item.request)
        now = time.monotonic()
        for token in sampled:
            outputs.append(self._append_token(token.request, token.token_id, token.logprobs, now))
        self.last_step_time_s = time.perf_counter() - start
        self.last_step_tokens = sched.num_tokens
        self.num_steps += 1
        return outputs

    def poll_connector(self) -> None:
        """Pick up finished/failed async loads and releasable blocks (step() does this too)."""
        if self.connector is None:
            return
        loaded, failed = self.connector.get_finished_loading(), self.connector.get_failed_loading()
        if loaded or failed:
            self.scheduler.finish_remote_loads(loaded, failed)
        for request_id in self.connector.get_finished_sending():
            request = self.delayed_free.pop(request_id, None)
            if request is not None:
                self.block_manager.free_blocks(request)

    def _fail_step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        outputs = []
        for item in sched.scheduled:
            self.scheduler.remove(item.request)
            outputs.append(self._finish(item.request, "error"))
        return outputs

    def _append_token(
        self, request: Request, token_id: int, logprobs: dict | None, now: float
    ) -> RequestOutput:
        request.append_token(token_id)
        if request.metrics["first_token_time"] is None:
            request.metrics["first_token_time"] = now
        request.metrics["last_token_time"] = now
        reason = None
        if token_id in request.stop_token_ids:
            reason = "stop"
        elif (
            request.num_output_tokens >= request.sampling_params.max_tokens
            or request.num_tokens >= self.model_info.max_model_len
        ):
            reason = "length"
        if reason is None:
            return self._output(request, [token_id], [logprobs] if logprobs else None)
        self.scheduler.remove(request)
        return self._finish(request, reason, [token_id], [logprobs] if logprobs else None)

    def _finish(
        self,
        request: Request,
        reason: str,
        new_token_ids: list[int] | None = None,
        new_logprobs: list[dict] | None = None,
    ) -> RequestOutput:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics["finished_time"] = time.monotonic()
        self.requests.pop(request.request_id, None)
        delay = False
        if self.connector is not None:
            try:
                delay, params = self.connector.request_finished(request, list(request.block_ids))
            except Exception:
                logger.exception("connector.request_finished failed for %s", request.request_id)
                delay, params = False, None
            request.output_kv_transfer_params = params
        if delay and request.block_ids:
            self.delayed_free[request.request_id] = request
        else:
            self.block_manager.free_blocks(request)
        return self._output(request, new_token_ids or [], new_logprobs)

    def _output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list[dict] | None
    ) -> RequestOutput:
        if request.sampling_params.logprobs is None:
            new_logprobs = None
        elif new_logprobs is None:
            new_logprobs = []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            kv_transfer_params=request.output_kv_transfer_params,
            metrics=dict(request.metrics),
        )

    def fail_all_requests(self) -> list[RequestOutput]:
        """Finish every unfinished request with "error" (after an unexpected failure)."""
        outputs = []
        for request in list(self.requests.values()):
            self.scheduler.remove(request)
            outputs.append(self._finish(request, "error"))
        return outputs

    # ---- introspection ------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        prefilling = [r for r in sched.running if r.num_computed_tokens < r.num_tokens - 1]
        decoding = [r for r in sched.running if r.num_computed_tokens >= r.num_tokens - 1]
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.waiting_for_remote),
            kv_usage=bm.usage,
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            prefix_cache_queried_tokens=sched.prefix_queried_tokens,
            prefix_cache_hit_tokens=sched.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
            last_step_time_s=self.last_step_time_s,
            last_step_tokens=self.last_step_tokens,
            num_waiting_prefill_tokens=sum(
                r.num_tokens - r.num_computed_tokens for r in [*sched.waiting, *prefilling]
            ),
            num_running_decode_blocks=sum(len(r.block_ids) for r in decoding),
        )

    def check_integrity(self) -> None:
        holders = [r for r in self.requests.values() if r.block_ids] + list(self.delayed_free.values())
        self.block_manager.check_integrity(holders)

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        if self.ec_connector is not None:
            self.ec_connector.shutdown()
