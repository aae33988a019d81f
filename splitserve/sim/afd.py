"""Attention-FFN disaggregation (AFD) of a MoE model's decode: A attention chips and F FFN
chips against expert parallelism over N chips, on the roofline, per decode step.

Expert parallelism (the baseline): every chip runs attention for its own B sequences (data
parallel), holds experts / N routed experts (and the shared experts), and two all-to-alls per
MoE layer move each token to the chips of its top-k experts and back.

AFD: the A attention chips run attention (and the dense layers and the head) for B sequences
each; the F FFN chips hold experts / F routed experts each and the shared experts; per MoE
layer each attention chip sends every token's hidden state to the FFN chips of its top-k
experts and receives their partial sums back. The experts of an FFN chip see the tokens of
all A attention chips: more attention chips per FFN chip, more tokens per expert per step
(decode experts are memory-bound: their weights are read once whatever the token count).

Dual micro-batch overlap (DBO) splits the batch in two: one half's transfers and the other
side's work run while the other half computes. Per MoE layer:

- EP: max(2 (attn + experts)(B/2), 2 (dispatch + combine)(B/2)); without DBO their sum at B.
- AFD: max(2 attn(B/2), 2 ffn(A B/2), 2 send, 2 receive, attn + send + ffn + receive (B/2)):
  the last is the chain one half must close before its next layer; without DBO, that
  chain at B.

Each dispatch/combine (EP) and send/receive (AFD) pays a fixed latency and its bytes over the
link: the latency of an all-to-all among the EP chips (or the F FFN chips), from DeepEP's
published low-latency figures (see all_to_all_latency_s). DeepSeek-V3.2's sparse attention
(DSA) scores every cached token with its indexer and attends only the top-k (see
attention_pair_costs).

Routing is uniform (as the plugin's forced balancing), a token's k experts land on
F (1 - (1 - 1/F)^k) distinct chips, activations cross in the model's dtype (bf16).

Memory sets each role's batch: a chip holds its weights and, in what is left, the KV of
whole sequences at the run's context. An EP chip holds every weight but the routed experts,
plus experts / N of them. An attention chip holds, under `split` (the default), only what it
runs: attention, router, dense layers, embeddings and head (the routed and the shared
experts live on the FFN chips, which compute them), so more of its memory is KV; under
`ep`, what an EP chip of the baseline holds (the batch of the EP baseline in every layout).
An FFN chip holds experts / F routed experts and the shared ones, and no KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.sim.afd_latency import (
    ALL_TO_ALL_LATENCY,
    TRANSFER_LATENCY_S,
    AllToAllLatency,
    all_to_all_latency_s,
)
from splitserve.sim.roofline import Efficiency
from splitserve.sim.specs import GPUSpec, ModelSpec

# what an attention chip holds: only the weights it runs, or an EP chip's share (see above)
ATTENTION_WEIGHTS = ("split", "ep")


@dataclass(frozen=True)
class AFDRun:
    """What is being run: each decode sequence's context; the batch per attention chip (None:
    what KV memory allows beside each role's weights), per EP chip if `ep_batch` is given, or
    `concurrency` sequences over the whole deployment split evenly across its attention chips
    (an EP chip is one); what an attention chip holds (`split` or `ep`, see the module's
    docstring); overlap (`ep_overlap` False: EP layouts without it, AFD's with it); the link;
    the all-to-all latency (`deepep`, `ascend`: published kernels', by rank count, see
    afd_latency; `fixed`: TRANSFER_LATENCY_S); and `experts_per_rank`, forced expert balancing
    (every EP or FFN rank computes only that many of its experts, all tokens routed to them)."""

    context: int = 16384
    batch: int | None = None
    ep_batch: int | None = None
    concurrency: int | None = None
    overlap: bool = True
    ep_overlap: bool = True
    experts_per_rank: int | None = None
    link_bw: float | None = None  # bytes/s per chip each way (None: the chip's link_bw)
    mem_util: float = 0.9
    weight_bytes: int | None = None  # bytes per weight (1: FP8/INT8 weights; None: the model's dtype)
    attention_weights: str = "split"
    all_to_all_latency: str = "deepep"

    def __post_init__(self) -> None:
        if self.context < 1 or any(n is not None and n < 1 for n in (self.batch, self.ep_batch)):
            raise ValueError("context and batch must be >= 1")
        if self.concurrency is not None and (self.concurrency < 1 or self.batch or self.ep_batch):
            raise ValueError("concurrency must be >= 1, and not given with a batch")
        if self.experts_per_rank is not None and self.experts_per_rank < 1:
            raise ValueError("experts per rank must be >= 1")
        if self.attention_weights not in ATTENTION_WEIGHTS:
            raise ValueError(f"attention weights must be one of {', '.join(ATTENTION_WEIGHTS)}")
        if self.all_to_all_latency not in ALL_TO_ALL_LATENCY:
            raise ValueError(f"all-to-all latency must be one of {', '.join(ALL_TO_ALL_LATENCY)}")
        if self.link_bw is not None and self.link_bw <= 0:
            raise ValueError("link bandwidth must be > 0")
        if self.weight_bytes is not None and self.weight_bytes < 1:
            raise ValueError("weight bytes must be >= 1")


class ChipMemory(NamedTuple):
    """What one chip of a layout holds: the attention chip's (the EP chip's) weights and the
    KV of its batch, and an FFN chip's weights (0 under EP)."""

    attention_weight_bytes: float
    kv_bytes_per_sequence: float
    # sequences per attention chip: the run's --batch, what the KV room holds, or the run's
    # concurrency over the attention chips (then a fraction where they do not divide it)
    batch: float
    ffn_weight_bytes: float

    @property
    def attention_kv_bytes(self) -> float:
        return self.batch * self.kv_bytes_per_sequence


class Layout(NamedTuple):
    attention: int  # chips running attention (all of them under expert parallelism)
    ffn: int  # FFN chips; 0: expert parallelism over the attention chips

    @property
    def chips(self) -> int:
        return self.attention + self.ffn

    def label(self) -> str:
        return f"EP{self.attention}" if self.ffn == 0 else f"{self.attention}A+{self.ffn}F"


class AFDModel:
    """Per-layer and per-step times of one layout (see the module's docstring)."""

    def __init__(
        self, model: ModelSpec, gpu: GPUSpec, eff: Efficiency = Efficiency(), run: AFDRun = AFDRun()
    ):
        if not model.is_moe:
            raise ValueError(f"{model.name} is not a mixture-of-experts model")
        if model.is_hybrid:  # its MoE layers do not each follow an attention layer
            raise ValueError(f"{model.name}: AFD of hybrid (Mamba) models is not modelled")
        self.model, self.gpu, self.eff, self.run = model, gpu, eff, run
        self.flops_per_s = gpu.peak_flops * eff.compute
        self.bytes_per_s = gpu.mem_bw * eff.bandwidth
        self.link_bw = run.link_bw or gpu.link_bw
        self.wbytes = run.weight_bytes or model.dtype_bytes

    # ---- the pieces -------------------------------------------------------------------
    def _time(self, flops: float, num_bytes: float) -> float:
        return max(flops / self.flops_per_s, num_bytes / self.bytes_per_s)

    def pair_flops(self) -> float:
        """Decode attention FLOPs per (query, cached token) pair in one layer. MLA decodes in
        its absorbed form (as FlashMLA and vLLM do): every head scores the whole latent plus
        the rope key and sums the latent, 2 H (2 kv_lora_rank + rope) FLOPs."""
        m = self.model
        if m.is_mla:
            return 2 * m.heads * (2 * m.kv_lora_rank + m.qk_rope_dim)
        return m.attn_flops_per_pair / m.attention_layers

    def attention_pair_costs(self) -> tuple[float, float]:
        """FLOPs and cache bytes of one layer's decode attention for one sequence at the run's
        context. Dense: every cached token is scored and summed. DSA (DeepSeek-V3.2): the
        lightning indexer scores every cached token against its own 132-byte key, then MLA
        reads and attends only the top-k (2,048) latents, so at 16K the main attention
        touches an eighth of the cache. The indexer runs in FP8 on GPUs; it is counted at the
        chip's dense rate here (the spec has no FP8 peak), which overstates it a little."""
        m, ctx = self.model, self.run.context
        if not m.is_sparse_attention:
            return self.pair_flops() * ctx, m.kv_bytes_per_token / m.attention_layers * ctx
        attended = m.attended_tokens(ctx)
        flops = self.pair_flops() * attended + m.indexer_flops_per_pair * ctx
        num_bytes = m.mla_bytes_per_token_layer * attended + m.index_key_bytes_per_token_layer * ctx
        return flops, num_bytes

    def _attention(self, seqs: float) -> tuple[float, float]:
        """FLOPs and bytes of one layer's attention for `seqs` sequences on one chip."""
        m = self.model
        pair_flops, cache_bytes = self.attention_pair_costs()
        flops = 2 * m.attn_params_per_layer * seqs + pair_flops * seqs
        return flops, m.attn_params_per_layer * self.wbytes + cache_bytes * seqs

    def attention_s(self, seqs: float) -> float:
        """One MoE layer's attention and router on one chip for `seqs` sequences."""
        flops, num_bytes = self._attention(seqs)
        router = self.model.hidden * self.model.experts
        return self._time(flops + 2 * router * seqs, num_bytes + router * self.wbytes)

    def dense_s(self, seqs: float) -> float:
        """The dense layers (attention + MLP) and the output head for `seqs` sequences."""
        m = self.model
        flops, num_bytes = self._attention(seqs)
        layer = self._time(
            flops + 2 * m.dense_mlp_params * seqs, num_bytes + m.dense_mlp_params * self.wbytes
        )
        return m.dense_layers * layer + self._time(2 * m.head_params * seqs, m.head_params * self.wbytes)

    def experts_s(self, tokens: float, chips: int, shared_tokens: float) -> float:
        """One MoE layer's experts on one of `chips` chips sharing the routed experts, when
        `tokens` tokens are routed over all of them; `shared_tokens` pass its shared experts."""
        m = self.model
        held = math.ceil(m.experts / chips)  # the most a chip holds (all of them get tokens)
        if self.run.experts_per_rank:  # forced balancing: only this many of them do
            held = min(held, self.run.experts_per_rank)
        touched = held * (1.0 - (1.0 - m.experts_per_token / self.routed_pool(chips)) ** tokens)
        routed = tokens * m.experts_per_token / chips
        shared = m.shared_experts * m.expert_params
        flops = 2 * m.expert_params * routed + 2 * shared * shared_tokens
        return self._time(flops, (touched * m.expert_params + shared) * self.wbytes)

    def routed_pool(self, chips: int) -> int:
        """The experts tokens are routed over when `chips` chips share them: all, or under
        forced balancing `experts_per_rank` of each chip's."""
        held = math.ceil(self.model.experts / chips)
        if self.run.experts_per_rank:
            held = min(held, self.run.experts_per_rank)
        return min(self.model.experts, held * chips)

    def copies_per_token(self, chips: int) -> float:
        """Distinct chips a token's top-k experts live on."""
        return chips * (1.0 - (1.0 - 1.0 / chips) ** self.model.experts_per_token)

    def latency_s(self, ranks: int) -> AllToAllLatency:
        """The fixed latency of a dispatch (tokens out) and a combine (sums back) among
        `ranks` chips: DeepEP's measured, or TRANSFER_LATENCY_S under `fixed`."""
        if self.run.all_to_all_latency == "fixed":
            return AllToAllLatency(TRANSFER_LATENCY_S, TRANSFER_LATENCY_S)
        return all_to_all_latency_s(ranks, self.run.all_to_all_latency)

    def transfer_s(self, tokens: float, latency_s: float = TRANSFER_LATENCY_S) -> float:
        """`tokens` hidden states over the link, in the model's dtype, after `latency_s`."""
        return tokens * self.model.hidden * self.model.dtype_bytes / self.link_bw + latency_s

    # ---- one MoE layer ----------------------------------------------------------------
    def layer_s(self, layout: Layout, batch: int) -> dict[str, float]:
        """The time of one MoE layer per decode step and the parts that set it."""
        a, f = layout
        overlap = self.run.overlap and (f > 0 or self.run.ep_overlap)
        micro = batch / 2 if overlap else float(batch)
        if f == 0:
            compute = self.attention_s(micro) + self.experts_s(a * micro, a, micro)
            copies, lat = micro * self.copies_per_token(a), self.latency_s(a)
            comm = self.transfer_s(copies, lat.dispatch_s) + self.transfer_s(copies, lat.combine_s)
            if overlap:
                parts = {"compute": 2 * compute, "all-to-all": 2 * comm}
            else:
                parts = {"compute + all-to-all": compute + comm}
            return {**parts, "layer_s": max(parts.values()), "ffn_s": 0.0}
        attn = self.attention_s(micro)
        ffn = self.experts_s(a * micro, f, a * micro / f)
        copies = micro * self.copies_per_token(f)
        # each direction: the attention chip's copies out, or an FFN chip's copies in; a
        # token's copies fan out to its experts' FFN chips, so the latency is that of an
        # all-to-all among the F FFN chips
        lat = self.latency_s(f)
        send = self.transfer_s(max(copies, a * copies / f), lat.dispatch_s)
        receive = self.transfer_s(max(copies, a * copies / f), lat.combine_s)
        chain = attn + send + ffn + receive
        if overlap:
            # the link is full duplex: the two halves' sends share one direction, their
            # receives the other
            parts = {
                "attention": 2 * attn,
                "FFN": 2 * ffn,
                "link": 2 * max(send, receive),
                "round trip": chain,
            }
        else:
            parts = {"round trip": chain}
        return {**parts, "layer_s": max(parts.values()), "ffn_s": (2 if overlap else 1) * ffn}

    # ---- memory per role --------------------------------------------------------------
    def kv_bytes_per_sequence(self) -> float:
        """One decode sequence's KV at the run's context, all attention layers."""
        return self.model.cache_bytes(self.run.context)

    def routed_params(self) -> int:
        m = self.model
        return m.experts * m.expert_params * m.moe_layers

    def ep_weight_bytes(self, chips: int) -> float:
        """An expert-parallel chip of `chips`: every weight but the routed experts, and its
        share of those."""
        m = self.model
        held = math.ceil(m.experts / chips) * m.expert_params * m.moe_layers
        return (m.total_params - self.routed_params() + held) * self.wbytes

    def split_attention_weight_bytes(self) -> float:
        """An attention chip that holds only what it runs: attention, router, dense layers,
        embeddings and head (the routed and shared experts are on the FFN chips)."""
        m = self.model
        shared = m.shared_experts * m.expert_params * m.moe_layers
        return (m.total_params - self.routed_params() - shared) * self.wbytes

    def ffn_weight_bytes(self, ffn: int) -> float:
        """An FFN chip of `ffn`: experts / ffn routed experts and the shared ones."""
        m = self.model
        return (math.ceil(m.experts / ffn) + m.shared_experts) * m.expert_params * m.moe_layers * self.wbytes

    def kv_batch(self, weight_bytes: float) -> int:
        """Sequences of the run's context whose KV fits beside `weight_bytes` on one chip."""
        room = self.gpu.mem_bytes * self.run.mem_util - weight_bytes
        if room <= 0:
            weights = f"{weight_bytes / 1e9:,.1f} GB of {self.model.name}'s weights"
            raise ValueError(f"{weights} do not fit on one {self.gpu.name}")
        return int(room // self.kv_bytes_per_sequence())

    def memory(self, layout: Layout, baseline_chips: int) -> ChipMemory:
        """What each role of `layout` holds and so its batch per attention chip (the run's
        --batch or --ep-batch pins it; its concurrency splits evenly over the attention chips,
        which must hold that KV); `baseline_chips` is the EP chip an `ep` attention chip copies."""
        a, f = layout
        if f == 0:
            weights = self.ep_weight_bytes(a)
        elif self.run.attention_weights == "ep":
            weights = self.ep_weight_bytes(baseline_chips)
        else:
            weights = self.split_attention_weight_bytes()
        pinned = self.run.ep_batch if f == 0 and self.run.ep_batch else self.run.batch
        batch: float = pinned or self.kv_batch(weights)
        if self.run.concurrency:
            batch = self.concurrency_batch(layout, weights)
        ffn = self.ffn_weight_bytes(f) if f else 0.0
        return ChipMemory(weights, self.kv_bytes_per_sequence(), batch, ffn)

    def concurrency_batch(self, layout: Layout, weight_bytes: float) -> float:
        """The run's concurrency split evenly over `layout`'s attention chips, refused where they
        would be idle (fewer sequences than chips) or their KV does not fit beside
        `weight_bytes`."""
        n, a = self.run.concurrency or 0, layout.attention
        if n < a:
            raise ValueError(
                f"--concurrency {n:,}: {layout.label()} has {a} attention chips, one sequence each at least"
            )
        room = self.kv_batch(weight_bytes)
        if n / a > room:
            raise ValueError(
                f"--concurrency {n:,}: {layout.label()}'s {a} attention chips hold {room} sequences of "
                f"{self.run.context:,} tokens each ({room * a:,} in all), not {n / a:,.1f}"
            )
        return n / a

    def ffn_fits(self, layout: Layout) -> bool:
        return self.ffn_weight_bytes(layout.ffn) <= self.gpu.mem_bytes * self.run.mem_util

    # ---- one decode step --------------------------------------------------------------
    def step(self, layout: Layout, batch: float) -> dict:
        """A decode step of `layout`, `batch` sequences per attention chip: its time, output
        tokens per second per chip, tokens per expert and what bounds it."""
        a, f = layout
        if a < 1 or f < 0:
            raise ValueError("a layout needs >= 1 attention chip and >= 0 FFN chips")
        layer = self.layer_s(layout, batch)
        moe = self.model.moe_layers
        # the per-step and per-sequence overheads (scheduling, launch, sampling) of the roofline's
        # efficiencies, as every other `sim` command charges them
        overhead = self.eff.overhead_s + self.eff.per_seq_overhead_s * batch
        step_s = moe * layer["layer_s"] + self.dense_s(batch) + overhead
        bound = max((k for k in layer if k not in ("layer_s", "ffn_s")), key=lambda k: layer[k])
        return {
            "layout": layout.label(),
            "attention_chips": a,
            "ffn_chips": f,
            "chips": layout.chips,
            "batch_per_attention_chip": batch,
            "step_s": step_s,
            "tokens_per_s_per_chip": a * batch / step_s / layout.chips,
            "tokens_per_expert": a * batch * self.model.experts_per_token / self.routed_pool(f or a),
            "ffn_busy": moe * layer["ffn_s"] / step_s if f else None,
            "bound": bound,
            # the dispatch and combine latency among the EP chips, or among the FFN chips
            "all_to_all_latency_s": self.latency_s(f or a)._asdict(),
        }


def compare(afd: AFDModel, baseline_chips: int, layouts: list[Layout]) -> dict:
    """Each layout's step against expert parallelism over `baseline_chips`, each at the batch
    per attention chip its memory allows (or the run's --batch for all)."""
    rows = []
    for layout in [Layout(baseline_chips, 0), *layouts]:
        memory = afd.memory(layout, baseline_chips)
        if memory.batch < 1:
            raise ValueError(
                f"{layout.label()}: no sequence of {afd.run.context:,} tokens fits beside the weights"
            )
        row = afd.step(layout, memory.batch)
        row["memory"] = {
            "attention_weight_bytes": memory.attention_weight_bytes,
            "kv_bytes_per_sequence": memory.kv_bytes_per_sequence,
            "attention_kv_bytes": memory.attention_kv_bytes,
            "ffn_weight_bytes": memory.ffn_weight_bytes,
        }
        rows.append(row)
    base, rows = rows[0], rows[1:]
    for row, layout in zip(rows, layouts, strict=True):
        row["vs_baseline"] = row["tokens_per_s_per_chip"] / base["tokens_per_s_per_chip"] - 1
        row["fits"] = not layout.ffn or afd.ffn_fits(layout)  # the FFN chips hold their experts
    fitting = [r for r in rows if r["fits"]]
    best = max(fitting, key=lambda r: r["tokens_per_s_per_chip"])["layout"] if fitting else None
    flops, cache_bytes = afd.attention_pair_costs()
    return {
        "batch": base["batch_per_attention_chip"],
        "concurrency": afd.run.concurrency,
        "attention_weights": afd.run.attention_weights,
        "all_to_all_latency": afd.run.all_to_all_latency,
        "experts_per_rank": afd.run.experts_per_rank,
        # one sequence's decode attention in one layer (DSA: the indexer over every cached
        # token and MLA over the top-k)
        "attention_per_sequence_layer": {
            "attended_tokens": afd.model.attended_tokens(afd.run.context),
            "flops": flops,
            "cache_bytes": cache_bytes,
        },
        "baseline": base,
        "layouts": rows,
        "best": best,
    }


def ratio_layouts(chips: int, experts: int) -> list[Layout]:
    """Expert parallelism over all `chips`, and every split into attention and FFN chips whose
    FFN chips share the routed experts evenly."""
    if chips < 2:
        raise ValueError("--chips must be >= 2 (at least one attention and one FFN chip)")
    return [Layout(chips, 0)] + [Layout(chips - f, f) for f in range(1, chips) if experts % f == 0]


def parse_layouts(text: str) -> list[Layout]:
    """`48:16,64:16` -> attention:FFN layouts (`64:0` is expert parallelism over 64 chips)."""
    out = []
    for part in text.split(","):
        try:
            a, f = (int(x) for x in part.split(":"))
        except ValueError as exc:
            raise ValueError(f"bad layout {part!r}: give ATTENTION:FFN chips, e.g. 48:16") from exc
        if a < 1 or f < 0:
            raise ValueError(f"bad layout {part!r}: >= 1 attention chip, >= 0 FFN chips")
        out.append(Layout(a, f))
    return out
