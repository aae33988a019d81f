"""Loads the model and sizes its paged KV cache; turns a scheduled step into tensors,
runs the decoder over that cache, samples."""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitserve.afd.ffn_client import FfnClient, attach_ffn
from splitserve.afd.microbatch import overlapped_forward, splits
from splitserve.config import EngineConfig
from splitserve.encoder_cache.connector import ECConnector
from splitserve.engine.cpu_lending import IdleCpuBorrower, StepThreads
from splitserve.engine.device import choose_dtype, choose_kv_cache_dtype, default_device, dtype_name
from splitserve.engine.multimodal import EncoderCache, MultiModalRunner
from splitserve.engine.outputs import ModelRunnerOutput, SampledToken
from splitserve.engine.request import ScheduledRequest
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.state_pool import MambaStatePool
from splitserve.kv.connector.base import KVCacheAllocator, KVConnector, RequestSlots, StepKVInfo
from splitserve.model.attention import AttentionMetadata, PrefillChunk
from splitserve.model.decoder import DecoderModel, load_model
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.gguf_loader import quantization_plan
from splitserve.model.loader import load_decoder_config
from splitserve.model.native import load_cpu_ops
from splitserve.model.nemotron_h import NemotronHModel, load_nemotron_h
from splitserve.model.nemotron_h_config import load_nemotron_h_config
from splitserve.model.qwen2_vl import Qwen2VLModel, is_qwen2_vl, load_qwen2_vl, load_qwen2_vl_config
from splitserve.model.sampler import Sampler, SeededDraw
from splitserve.model_files.architectures import is_hybrid_model
from splitserve.runtime.access import internal_token


def kv_cache_shape(config: DecoderConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def kv_block_bytes(config: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element


class ModelInfo(NamedTuple):
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    block_size: int
    dtype: str
    device: str
    kv_cache_dtype: str


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        ec_connector: ECConnector | None = None,  # visual embeddings from encoder workers
    ) -> None:
        # a vision-language model: its language model is the decoder the engine pages
        self.vl_config = load_qwen2_vl_config(config.model.model) if is_qwen2_vl(config.model.model) else None
        # a hybrid (attention + Mamba2) model: its attention layers are the ones paged
        self.hybrid_config = (
            load_nemotron_h_config(config.model.model) if is_hybrid_model(config.model.model) else None
        )
        self.decoder_config = (
            self.vl_config.text
            if self.vl_config
            else self.hybrid_config.text
            if self.hybrid_config
            else load_decoder_config(config.model.model)
        )
        dc = self.decoder_config
        self.device = torch.device(config.model.device) if config.model.device else default_device()
        # a GGUF file's Q8_0/Q4_x projections kept in their blocks: their activations (the
        # residual stream, attention, KV) stay float32 unless a dtype is named, as
        # llama.cpp's do (bf16 on top of the int8 rounding: a larger logit error on the
        # demo model, docs/engine-kernels.md)
        quantized = quantization_plan(config.model.model, config.model.quantization, config.model.dtype)
        requested_dtype = config.model.dtype or ("float32" if quantized else None)
        self.dtype = choose_dtype(requested_dtype, dc.dtype, self.device)
        self.kv_cache_dtype = choose_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        if self.device.type == "cpu":
            # built and loaded here, before any part says it is healthy: never on a request
            load_cpu_ops()
        self.block_size = block_size = config.cache.block_size
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = config.cache.num_blocks or (
            config.cache.kv_cache_memory_bytes // kv_block_bytes(dc, block_size, self.kv_cache_dtype)
        )
        if self.num_blocks < 1:
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
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            kv_cache_dtype=dtype_name(self.kv_cache_dtype),
        )
        self.model: DecoderModel | Qwen2VLModel | NemotronHModel
        self.multimodal: MultiModalRunner | None = None  # for a vision-language model
        self.ffn: FfnClient | None = None  # attention-FFN disaggregation: the experts' daemon
        self.afd_microbatches = config.afd.microbatches if config.afd is not None else 1
        self.state_pool: MambaStatePool | None = None  # for a hybrid model: one slot per running request
        if config.afd is not None and (self.vl_config is not None or self.hybrid_config is not None):
            raise ValueError("attention-FFN disaggregation serves mixture-of-experts text models only")
        if self.hybrid_config is not None:
            hybrid = self.hybrid_config
            self.model = load_nemotron_h(config.model.model, hybrid, self.dtype, self.device)
            slot_bytes = MambaStatePool.bytes_per_slot(hybrid.num_mamba_layers, hybrid.mamba, self.dtype)
            num_slots = min(config.scheduler.max_num_seqs, config.cache.state_cache_bytes // slot_bytes)
            if num_slots < 1:
                raise ValueError(
                    f"the state cache budget holds no request's Mamba state ({slot_bytes} bytes)"
                )
            self.state_pool = MambaStatePool(
                num_slots,
                hybrid.num_mamba_layers,
                hybrid.mamba,
                self.dtype,
                self.device,
                block_size,
                config.cache.state_snapshot_bytes if config.cache.enable_prefix_caching else 0,
            )
            if connector is not None:  # P/D: the state travels with the KV, whole
                connector.register_state(self.state_pool.slot_bytes)
                self.state_pool.hand_over_states = True
        elif self.vl_config is None:
            self.model = load_model(
                config.model.model, dc, self.dtype, self.device, config.afd is None, quantized
            )
            if config.afd is not None:
                self.ffn = attach_ffn(
                    self.model,
                    config.afd,
                    self.dtype,
                    internal_token(),
                    config.scheduler.max_num_batched_tokens,
                )
        else:
            self.model = load_qwen2_vl(config.model.model, self.vl_config, self.dtype, self.device)
            encoder_cache = EncoderCache(config.cache.encoder_cache_bytes)
            self.multimodal = MultiModalRunner(self.model, encoder_cache, ec_connector)
        self.model.prepare_for_inference()
        self.kv_cache_allocator = (
            kv_cache_allocator or (connector.kv_cache_allocator() if connector else None) or torch.zeros
        )
        self.kv_cache = self.kv_cache_allocator(
            kv_cache_shape(dc, self.num_blocks, block_size), dtype=self.kv_cache_dtype, device=self.device
        )
        self.sampler = Sampler(self.device, config.model.seed)
        self.connector = connector
        # CPU: steps of at most this many tokens run on one thread, larger ones on all of
        # this engine's CPUs and its idle lenders' (engine/cpu_lending.py)
        on_cpu = self.device.type == "cpu"
        borrow = config.cpu_lending.borrow_files
        self.step_threads = StepThreads(
            config.model.serial_step_tokens if on_cpu else 0,
            IdleCpuBorrower(borrow) if borrow and on_cpu else None,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = [s for s in scheduler_output.scheduled if s.num_tokens > 0]
        self.step_threads.use_for(sum(s.num_tokens for s in scheduled))
        bs = self.block_size
        # decode-like (one token) first: they share one batched attention call
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in decodes:
            pos = s.position_start
            input_ids.append(s.request.all_token_ids[pos])
            positions.append(pos)
            slots.append(s.request.block_ids[pos // bs] * bs + pos % bs)
        chunks: list[PrefillChunk] = []
        prefill_slot_parts: list[torch.Tensor] = []
        offset = len(decodes)
        for s in prefills:
            start, end = s.position_start, s.position_start + s.num_tokens
            input_ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = torch.tensor(s.request.block_ids[: -(-end // bs)], dtype=torch.long)
            pos = torch.arange(start, end)
            prefill_slot_parts.append(table[pos // bs] * bs + pos % bs)
            chunks.append(PrefillChunk(offset, s.num_tokens, start, table.to(self.device, torch.int32)))
            offset += s.num_tokens
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        if prefill_slot_parts:
            slot_mapping = torch.cat([slot_mapping, *prefill_slot_parts])
        slot_mapping = slot_mapping.to(self.device)

        block_tables, context_lens = self._decode_tables(decodes)
        meta = AttentionMetadata(slot_mapping, len(decodes), block_tables, context_lens, chunks)

        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        row = 0
        for s in ordered:
            row += s.num_tokens
            if s.position_start + s.num_tokens == s.request.num_tokens:
                sample_rows.append(row - 1)
                sampling.append(s)

        before_layer = after_layer = None
        step_info = None
        if self.connector is not None:
            starts = [0]
            for s in ordered:
                starts.append(starts[-1] + s.num_tokens)
            step_info = StepKVInfo(
                [
                    RequestSlots(
                        s.request.request_id,
                        starts[i],
                        s.num_tokens,
                        s.position_start,
                        list(s.request.block_ids),
                    )
                    for i, s in enumerate(ordered)
                ],
                slot_mapping,
                bs,
            )
            connector, info = self.connector, step_info
            connector.start_load_kv(info)
            if connector.uses_layer_hooks(info):
                before_layer = connector.wait_for_layer_load

                def after_layer(i: int, kv_layer: torch.Tensor) -> None:
                    connector.save_kv_layer(i, kv_layer, info)

        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        inputs_embeds = None
        if self.multimodal is not None:  # M-RoPE positions [3, T]; image embeddings merged in
            positions_t, inputs_embeds = self.multimodal.step_inputs(ordered, input_ids_t, positions_t)
        sample_rows_t = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        if self.state_pool is not None:
            assert isinstance(self.model, NemotronHModel)
            mamba = self.state_pool.step_metadata(ordered, self.device)
            logits = self.model(
                input_ids_t, positions_t, self.kv_cache, meta, sample_rows_t, before_layer, after_layer,
                mamba=mamba,
            )  # fmt: skip
            self.state_pool.save_step_snapshots()
            if self.connector is not None:
                for request_id, state in self.state_pool.take_step_handoffs():
                    self.connector.save_state(request_id, state)
        elif self.ffn is not None and splits(meta, self.afd_microbatches):
            assert isinstance(self.model, DecoderModel)
            logits = overlapped_forward(
                self.model,
                self.ffn,
                input_ids_t,
                positions_t,
                self.kv_cache,
                meta,
                sample_rows_t,
                before_layer,
                after_layer,
            )
        else:
            logits = self.model(
                input_ids_t,
                positions_t,
                self.kv_cache,
                meta,
                sample_rows_t,
                before_layer,
                after_layer,
                inputs_embeds=inputs_embeds,
            )
        if self.connector is not None:
            self.connector.wait_for_save()
        if not sampling:
            return ModelRunnerOutput([])
        params = [s.request.sampling_params for s in sampling]
        seeded = [
            None
            if p.seed is None
            else SeededDraw(p.seed, p.preceding_output_tokens + s.request.num_output_tokens)
            for p, s in zip(params, sampling, strict=True)
        ]
        out = self.sampler(logits, params, seeded)
        return ModelRunnerOutput(
            [
                SampledToken(s.request, token, lp)
                for s, token, lp in zip(sampling, out.token_ids, out.logprobs, strict=True)
            ]
        )

    def _decode_tables(self, decodes: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decode row's block table (int32, padded with block 0) and context length."""
        bs = self.block_size
        contexts = [s.position_start + 1 for s in decodes]
        width = -(-max(contexts, default=0) // bs)
        rows = [s.request.block_ids[: -(-c // bs)] for s, c in zip(decodes, contexts, strict=True)]
        tables = [row + [0] * (width - len(row)) for row in rows]
        return (
            torch.tensor(tables, dtype=torch.int32).view(len(decodes), width).to(self.device),
            torch.tensor(contexts, dtype=torch.int32).to(self.device),
        )
