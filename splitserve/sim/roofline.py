"""Roofline cost model: FLOPs and bytes of prefill and decode steps, and their duration.

A pass over n tokens does ~2 FLOPs per weight per token and reads every weight once, so
prefill (n ~ thousands) is compute-bound and decode (n = batch size) is memory-bound.
Two ways to turn a step's cost into time:

- "max" (the seed's model): the whole step takes max(FLOPs / achieved FLOP/s, bytes /
  achieved bandwidth), as if compute and memory traffic overlapped perfectly.
- "sum" (per kernel): the linear layers take max(their FLOPs, the weight reads), then the
  prefill attention (compute) and the decode attention (reading every cached K and V) run
  after them. Closer to what a GPU does: the decode attention of a big batch is its own
  memory-bound kernel and does not hide under a prefill chunk's matrix multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from splitserve.sim.specs import GPUSpec, ModelSpec

ALLREDUCE_LATENCY_S = 15e-6  # fixed cost of one all-reduce between GPUs of an instance


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak, and a fixed per-step cost (scheduling, launch, sampling).
    Defaults: the seed's calibration to the guide's low-load medians (TTFT ~0.7 s, ITL ~22 ms)."""

    compute: float = 0.47
    bandwidth: float = 0.75
    overhead_s: float = 0.002
    attention: float | None = None  # prefill attention's fraction of peak (None: as `compute`)
    per_seq_overhead_s: float = 0.0  # CPU cost per sequence in a step (scheduling, sampling)
    # Small chunks run their matrix multiplies below `compute` (tiles and waves part empty):
    # a step with prefill tokens computes as if it had this many more (an n-token chunk runs
    # at compute * n / (n + small_chunk_tokens)).
    small_chunk_tokens: float = 0.0
    # decode attention's fraction of peak bandwidth reading cached K and V (None: as
    # `bandwidth`); paged-attention kernels gathering many small blocks run below the GEMMs
    kv_bandwidth: float | None = None

    def __post_init__(self) -> None:
        # up to 5: a fit against a nominal peak (a CPU's matmul and copy rates, measured on a
        # shared host) may beat it several times over
        attn = self.compute if self.attention is None else self.attention
        kv = self.bandwidth if self.kv_bandwidth is None else self.kv_bandwidth
        if not all(0 < e <= 5 for e in (self.compute, self.bandwidth, attn, kv)):
            raise ValueError("efficiencies must be fractions of peak in (0, 1] (at most 5 for nominal peaks)")
        if self.overhead_s < 0 or self.per_seq_overhead_s < 0 or self.small_chunk_tokens < 0:
            raise ValueError("overheads must be >= 0")


class Cost(NamedTuple):
    linear_flops: float
    prefill_attn_flops: float
    decode_attn_flops: float
    weight_bytes: float
    kv_bytes: float
    tokens: int
    seqs: int  # sequences in the step (each costs per_seq_overhead_s)
    prefill_tokens: int = 0  # prompt tokens in the step (small-chunk efficiency)

    @property
    def flops(self) -> float:
        return self.linear_flops + self.prefill_attn_flops + self.decode_attn_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def __add__(self, other: Cost) -> Cost:  # type: ignore[override]
        """Two pieces of work in one step: FLOPs add, weights are read once, KV reads add."""
        return Cost(
            self.linear_flops + other.linear_flops,
            self.prefill_attn_flops + other.prefill_attn_flops,
            self.decode_attn_flops + other.decode_attn_flops,
            max(self.weight_bytes, other.weight_bytes),
            self.kv_bytes + other.kv_bytes,
            self.tokens + other.tokens,
            self.seqs + other.seqs,
            self.prefill_tokens + other.prefill_tokens,
        )


ZERO = Cost(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)


class Roofline:
    """Step costs and times of one instance: `tp` GPUs running one model replica."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        eff: Efficiency = Efficiency(),
        tp: int = 1,
        combine: str = "max",
    ) -> None:
        if tp < 1:
            raise ValueError("tp must be >= 1")
        if combine not in ("max", "sum"):
            raise ValueError("combine must be 'max' or 'sum'")
        self.model, self.gpu, self.eff, self.tp, self.combine = model, gpu, eff, tp, combine
        self.flops_per_s = gpu.peak_flops * eff.compute * tp
        self.bytes_per_s = gpu.mem_bw * eff.bandwidth * tp
        kv_eff = eff.bandwidth if eff.kv_bandwidth is None else eff.kv_bandwidth
        self.kv_bytes_per_s = gpu.mem_bw * kv_eff * tp
        attn = eff.compute if eff.attention is None else eff.attention
        self.attn_flops_per_s = gpu.peak_flops * attn * tp
        # a hybrid's Mamba layers also run their recurrence per token (not a matmul; small)
        self._flops_per_token = (
            2.0 * (model.active_layer_params + model.head_params) + model.ssm_flops_per_token
        )
        # decode reads and writes every running sequence's Mamba state each step
        self._state_bytes_per_seq = 2.0 * model.state_bytes_per_request
        self.small_chunk_flops = 2.0 * model.active_layer_params * eff.small_chunk_tokens
        self._dense_weight_bytes = (model.layer_params + model.head_params) * model.dtype_bytes

    @property
    def ridge(self) -> float:
        return self.gpu.ridge

    def weights_read(self, tokens: int) -> float:
        """Weight bytes one forward pass over `tokens` tokens reads. For MoE, only the experts
        some token was routed to (expected count under uniform routing)."""
        m = self.model
        if not m.is_moe:  # every step reads them all: summed once (a hot path of the simulator)
            return self._dense_weight_bytes
        touched = m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** max(tokens, 1))
        unread = m.moe_layers * (m.experts - touched) * m.expert_params
        return (m.layer_params - unread + m.head_params) * m.dtype_bytes

    def prefill(self, n: int, past: int = 0) -> Cost:
        """Prefill `n` new tokens after `past` cached ones (logits for the last token only).
        Reads of the past KV are left out (as in the seed): prefill is compute-bound."""
        m = self.model
        linear = (2.0 * m.active_layer_params + m.ssm_flops_per_token) * n + 2.0 * m.head_params
        keys = past + (n + 1) / 2  # average keys each new token attends to (causal)
        return Cost(linear, m.attn_flops_per_pair * n * keys, 0.0, self.weights_read(n), 0.0, n, 1, n)

    def decode(self, batch: int, context_total: float) -> Cost:
        """One decode step for `batch` sequences whose contexts sum to `context_total` tokens."""
        if batch == 0:
            return ZERO
        m = self.model
        return Cost(
            self._flops_per_token * batch,
            0.0,
            m.attn_flops_per_pair * context_total,
            self.weights_read(batch),
            m.kv_bytes_per_token * context_total + self._state_bytes_per_seq * batch,
            batch,
            batch,
        )

    def comm_s(self, tokens: float) -> float:
        """All-reduces of the hidden state under tensor parallelism: two per layer (one per
        hybrid layer)."""
        if self.tp == 1:
            return 0.0
        m = self.model
        volume = 2 * (self.tp - 1) / self.tp * tokens * m.hidden * m.dtype_bytes
        return m.allreduces_per_pass * (volume / self.gpu.link_bw + ALLREDUCE_LATENCY_S)

    def ideal_s(self, cost: Cost) -> float:
        """Pure roofline at peak, no efficiency factors, no overhead (the seed's 'ideal time')."""
        return max(cost.flops / (self.gpu.peak_flops * self.tp), cost.bytes / (self.gpu.mem_bw * self.tp))

    def bound(self, cost: Cost) -> str:
        return "compute" if cost.intensity > self.ridge else "memory"

    def step_s(self, cost: Cost) -> float:
        if cost.tokens == 0:
            return 0.0
        fill = self.small_chunk_flops if cost.prefill_tokens else 0.0
        return float(
            self._combine(
                cost.linear_flops + fill,
                cost.prefill_attn_flops,
                cost.decode_attn_flops,
                cost.weight_bytes,
                cost.kv_bytes,
            )
            + self.comm_s(cost.tokens)
            + self.eff.overhead_s
            + self.eff.per_seq_overhead_s * cost.seqs
        )

    def _combine(self, linear, prefill_attn, decode_attn, weights, kv):
        f, b, fa, bkv = self.flops_per_s, self.bytes_per_s, self.attn_flops_per_s, self.kv_bytes_per_s
        if self.combine == "max":
            return np.maximum((linear + decode_attn) / f + prefill_attn / fa, weights / b + kv / bkv)
        return np.maximum(linear / f, weights / b) + prefill_attn / fa + np.maximum(decode_attn / f, kv / bkv)

    def decode_times(self, batch: int, context_totals: np.ndarray) -> np.ndarray:
        """Durations of consecutive decode-only steps (vectorized over their context sums)."""
        m = self.model
        t = self._combine(
            self._flops_per_token * batch,
            0.0,
            m.attn_flops_per_pair * context_totals,
            self.weights_read(batch),
            m.kv_bytes_per_token * context_totals + self._state_bytes_per_seq * batch,
        )
        return t + (self.comm_s(batch) + self.eff.overhead_s + self.eff.per_seq_overhead_s * batch)

    def cache_room_bytes(self, mem_util: float = 0.9) -> float:
        """Memory left next to the weights on this instance's GPUs for KV and Mamba state."""
        return max(0.0, self.tp * self.gpu.mem_bytes * mem_util - self.model.weight_bytes)

    def kv_capacity_tokens(self, mem_util: float = 0.9) -> int:
        """Tokens of KV cache that fit next to the weights on this instance's GPUs."""
        return int(self.cache_room_bytes(mem_util) // max(1, self.model.kv_bytes_per_token))

    def state_slot_tokens(self) -> int:
        """A hybrid request's Mamba state slot in tokens of KV (what it takes from the same
        memory, rounded up): 0 for a model without Mamba layers."""
        state = self.model.state_bytes_per_request
        return -(-state // max(1, self.model.kv_bytes_per_token)) if state else 0

    def max_sequences(self, context: int, mem_util: float = 0.9) -> int:
        """Sequences of `context` tokens whose KV and Mamba state fit at once."""
        return int(self.cache_room_bytes(mem_util) // max(1, self.model.cache_bytes(context)))
