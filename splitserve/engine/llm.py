"""Offline Python API: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.encoder_cache.connector import ECConnector
from splitserve.engine.kv_store_client import KVStoreClient
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kv.connector.base import KVConnector
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import KVTransferParams
from splitserve.protocol.multimodal import ImageInput
from splitserve.protocol.sampling_params import SamplingParams

_MODEL_KEYS = ("dtype", "quantization", "device", "seed", "serial_step_tokens")
_CACHE_KEYS = (
    "block_size",
    "kv_cache_memory_bytes",
    "num_blocks",
    "kv_cache_dtype",
    "enable_prefix_caching",
    "encoder_cache_bytes",
    "state_cache_bytes",
    "state_snapshot_bytes",
)
_SCHEDULER_KEYS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "long_prefill_token_threshold")


class CompletionResult(NamedTuple):
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None
    num_cached_tokens: int
    kv_transfer_params: dict | None


def engine_config_from_kwargs(model: str, **kwargs: Any) -> EngineConfig:
    """EngineConfig from flat keyword arguments (dtype, num_blocks, max_num_seqs, ...)."""
    unknown = set(kwargs) - {*_MODEL_KEYS, *_CACHE_KEYS, *_SCHEDULER_KEYS, "role"}
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    pick = lambda keys: {k: kwargs[k] for k in keys if k in kwargs}  # noqa: E731
    return EngineConfig(
        model=ModelConfig(model, **pick(_MODEL_KEYS)),
        cache=CacheConfig(**pick(_CACHE_KEYS)),
        scheduler=SchedulerConfig(**pick(_SCHEDULER_KEYS)),
        role=kwargs.get("role", "both"),
    )


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        connector: KVConnector | None = None,
        ec_connector: ECConnector | None = None,
        kv_store: KVStoreClient | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if config is None:
            from splitserve.model_files.resolve import resolve_model

            config = engine_config_from_kwargs(resolve_model(model).path, **engine_kwargs)
        self.engine = LLMEngine(config, connector, ec_connector=ec_connector, kv_store=kv_store)
        self._counter = 0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        kv_transfer_params: Sequence[dict | None] | None = None,
        cache_salt: str | None = None,
        images: Sequence[list[ImageInput] | None] | None = None,
    ) -> list[CompletionResult]:
        """Run every prompt (token IDs) to completion, batched; results in prompt order.
        `images`: per prompt, its images (a vision-language model's), or None."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("one SamplingParams per prompt, or a single one for all")
        transfer = list(kv_transfer_params) if kv_transfer_params is not None else [None] * len(prompts)
        prompt_images = list(images) if images is not None else [None] * len(prompts)
        ids = []
        for prompt, param, kv_params, image_inputs in zip(
            prompts, params, transfer, prompt_images, strict=True
        ):
            self._counter += 1
            request_id = f"llm-{self._counter}"
            self.engine.add_request(
                GenerateRequest(
                    request_id,
                    tuple(prompt),
                    param,
                    cache_salt=cache_salt,
                    # the wire form a prefill's result reports, as the HTTP edge takes it
                    kv_transfer_params=KVTransferParams.from_wire(kv_params)
                    if kv_params is not None
                    else None,
                    images=tuple(image_inputs or ()),
                )
            )
            ids.append(request_id)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[dict]] = {i: [] for i in ids}
        final = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.request_id not in tokens:
                    continue
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(out.new_logprobs or [])
                if out.finished:
                    final[out.request_id] = out
        return [
            CompletionResult(
                list(prompt),
                tokens[i],
                final[i].finish_reason,
                logprobs[i] if param.logprobs is not None else None,
                final[i].num_cached_tokens,
                final[i].kv_transfer_params,
            )
            for i, prompt, param in zip(ids, prompts, params, strict=True)
        ]
