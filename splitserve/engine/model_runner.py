"""Turns a scheduled step into tensors, runs the decoder over the paged KV cache, samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.engine.multimodal import MultiModalRunner
from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledRequest
from splitserve.kv.connector import KVConnector, RequestSlots, StepKVInfo
from splitserve.model.attention import AttentionMetadata, PrefillChunk
from splitserve.model.decoder import DecoderModel
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.sampler import Sampler, SeededDraw

KVCacheAllocator = Callable[..., torch.Tensor]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[name]


def kv_cache_shape(config: DecoderConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def kv_block_bytes(config: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element


class SampledToken(NamedTuple):
    request: Request
    token_id: int
    logprobs: dict | None


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        connector: KVConnector | None = None,
        multimodal: MultiModalRunner | None = None,  # for a vision-language model
        serial_step_tokens: int = 0,  # CPU: steps of at most this many tokens run on one thread
    ) -> None:
        self.model = model
        self.multimodal = multimodal
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.connector = connector
        self.serial_step_tokens = serial_step_tokens if device.type == "cpu" else 0
        self.parallel_threads = torch.get_num_threads()

    def _use_threads_for(self, num_tokens: int) -> None:
        wanted = 1 if num_tokens <= self.serial_step_tokens else self.parallel_threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> list[SampledToken]:
        self._use_threads_for(sum(s.num_tokens for s in scheduled))
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
            before_layer = connector.wait_for_layer_load

            def after_layer(i: int, kv_layer: torch.Tensor) -> None:
                connector.save_kv_layer(i, kv_layer, info)

        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        inputs_embeds = None
        if self.multimodal is not None:  # M-RoPE positions [3, T]; image embeddings merged in
            positions_t, inputs_embeds = self.multimodal.step_inputs(ordered, input_ids_t, positions_t)
        logits = self.model(
            input_ids_t,
            positions_t,
            self.kv_cache,
            meta,
            torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            before_layer,
            after_layer,
            inputs_embeds=inputs_embeds,
        )
        if self.connector is not None:
            self.connector.wait_for_save()
        if not sampling:
            return []
        params = [s.request.sampling_params for s in sampling]
        seeded = [
            None
            if p.seed is None
            else SeededDraw(p.seed, p.preceding_output_tokens + s.request.num_output_tokens)
            for p, s in zip(params, sampling, strict=True)
        ]
        out = self.sampler(logits, params, seeded)
        return [
            SampledToken(s.request, token, lp)
            for s, token, lp in zip(sampling, out.token_ids, out.logprobs, strict=True)
        ]

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
