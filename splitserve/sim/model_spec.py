"""A model's cost-relevant shape (`ModelSpec`): what the roofline, the KV arithmetic and the
simulator read. Built-in models and HF config.json reading live in specs.py.

Parameter counts follow the seed's convention: weight matrices only (biases and norms are
below 0.1% and left out), the input embedding is resident but not read per step, the output
head is read every step (and counted separately so a tied head is not counted twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.sim.mamba import ATTENTION, MAMBA, MLP, MOE, MambaSpec, check_pattern


class SpecError(ValueError):
    """An unknown or malformed GPU/model spec (the CLI turns it into a clear message)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (SwiGLU: 3 matrices)
    vocab: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2
    # mixture of experts (0 experts = dense)
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model (DeepSeek)
    # multi-head latent attention (kv_lora_rank > 0 = MLA)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DSA, DeepSeek-V3.2): a lightning indexer of index_heads heads of
    # index_head_dim scores every cached token from an FP8 key of its own, and the MLA
    # attention reads only the index_topk best (index_topk = 0: dense attention)
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # hybrid (Nemotron-H): one character per layer, M Mamba2, * attention, - MLP, E MoE
    # ("" = every layer attention + MLP/MoE); each layer is one mixer
    pattern: str = ""
    mamba: MambaSpec | None = None
    mlp_matrices: int = 3  # SwiGLU: gate, up, down; relu^2 (Nemotron-H): up, down

    def __post_init__(self) -> None:
        if self.pattern:
            try:
                check_pattern(self.pattern, self.layers)
            except ValueError as exc:
                raise SpecError(f"{self.name}: {exc}") from exc
            if (MAMBA in self.pattern) != (self.mamba is not None):
                raise SpecError(f"{self.name}: Mamba layers need a Mamba geometry, and only they")
            if (MOE in self.pattern) != self.is_moe:
                raise SpecError(f"{self.name}: MoE layers (E) need experts, and only they")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_sparse_attention(self) -> bool:
        return self.index_topk > 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.pattern)

    # ---- layers of each kind --------------------------------------------------------------
    @property
    def attention_layers(self) -> int:
        return self.pattern.count(ATTENTION) if self.pattern else self.layers

    @property
    def mamba_layers(self) -> int:
        return self.pattern.count(MAMBA)

    @property
    def moe_layers(self) -> int:
        if self.pattern:
            return self.pattern.count(MOE)
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def mlp_layers(self) -> int:
        """Layers with a dense MLP."""
        return self.pattern.count(MLP) if self.pattern else self.layers - self.moe_layers

    @property
    def allreduces_per_pass(self) -> int:
        """Under tensor parallelism each mixer and each MLP ends in one all-reduce: two per
        attention + MLP layer, one per hybrid layer (each is a single mixer)."""
        return self.layers if self.pattern else 2 * self.layers

    # ---- Mamba state ----------------------------------------------------------------------
    def mamba_state_bytes_per_layer(self, tp: int = 1) -> int:
        return self.mamba.state_bytes(self.dtype_bytes, tp) if self.mamba else 0

    @property
    def state_bytes_per_request(self) -> int:
        """Every Mamba layer's state for one request: fixed, whatever its length."""
        return self.mamba_layers * self.mamba_state_bytes_per_layer()

    @property
    def ssm_flops_per_token(self) -> int:
        return self.mamba_layers * self.mamba.scan_flops_per_token if self.mamba else 0

    def cache_bytes(self, tokens: int) -> int:
        """What one request of `tokens` tokens holds: attention KV per token plus Mamba state."""
        return tokens * self.kv_bytes_per_token + self.state_bytes_per_request

    # ---- parameters -------------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        d, h = self.hidden, self.heads
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = d * self.q_lora_rank + self.q_lora_rank * h * qk if self.q_lora_rank else d * h * qk
            kv = d * (self.kv_lora_rank + self.qk_rope_dim)
            kv += self.kv_lora_rank * h * (self.qk_nope_dim + self.v_head_dim)
            return q + kv + h * self.v_head_dim * d + self.indexer_params_per_layer
        hd = self.head_dim
        return d * h * hd + 2 * d * self.kv_heads * hd + h * hd * d

    @property
    def indexer_params_per_layer(self) -> int:
        """DSA's lightning indexer: its query from the compressed query (wq_b), one key head
        from the hidden state (wk) and a weight per head (weights_proj), as DeepSeek-V3.2-Exp's
        inference/model.py builds them."""
        if not self.is_sparse_attention:
            return 0
        hi, di = self.index_heads, self.index_head_dim
        return (self.q_lora_rank or self.hidden) * hi * di + self.hidden * di + self.hidden * hi

    @property
    def dense_mlp_params(self) -> int:
        return self.mlp_matrices * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        return self.mlp_matrices * self.hidden * self.moe_intermediate

    @property
    def _mixer_params(self) -> int:
        """Attention and Mamba weights of the whole stack."""
        mamba = self.mamba_layers * self.mamba.params(self.hidden) if self.mamba else 0
        return self.attention_layers * self.attn_params_per_layer + mamba

    @property
    def layer_params(self) -> int:
        """All non-embedding weights of the decoder stack (every expert counted)."""
        moe_mlp = (self.experts + self.shared_experts) * self.expert_params + self.hidden * self.experts
        return self._mixer_params + self.mlp_layers * self.dense_mlp_params + self.moe_layers * moe_mlp

    @property
    def active_layer_params(self) -> int:
        """Non-embedding weights one token multiplies through (routed top-k + shared experts)."""
        if not self.is_moe:
            return self.layer_params
        active = (
            self.experts_per_token + self.shared_experts
        ) * self.expert_params + self.hidden * self.experts
        return self._mixer_params + self.mlp_layers * self.dense_mlp_params + self.moe_layers * active

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        embeddings = self.vocab * self.hidden
        return self.layer_params + embeddings + (0 if self.tie_embeddings else self.head_params)

    @property
    def weight_bytes(self) -> float:
        """Resident weights (what must fit in memory)."""
        return self.total_params * self.dtype_bytes

    # ---- attention ----------------------------------------------------------------------
    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs for one (query token, key token) pair summed over layers: QK^T and AV."""
        n = self.attention_layers
        if self.is_mla:
            return 2 * n * self.heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        return 4 * n * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        if self.is_mla:  # one compressed latent + the shared rope key per layer (+ DSA's index key)
            latent = self.attention_layers * self.mla_bytes_per_token_layer
            return latent + self.attention_layers * self.index_key_bytes_per_token_layer
        return self.attention_layers * self.kv_bytes_per_token_layer()

    @property
    def mla_bytes_per_token_layer(self) -> int:
        """One MLA layer's cache per token: the compressed latent and the shared rope key."""
        return (self.kv_lora_rank + self.qk_rope_dim) * self.dtype_bytes

    @property
    def index_key_bytes_per_token_layer(self) -> int:
        """DSA's indexer key per token and layer: FP8 values and one fp32 scale per block of
        128 (DeepSeek-V3.2-Exp's k_cache and k_scale_cache): 128 + 4 bytes."""
        if not self.is_sparse_attention:
            return 0
        return self.index_head_dim + 4 * -(-self.index_head_dim // 128)

    @property
    def indexer_flops_per_pair(self) -> int:
        """DSA's indexer per (query, cached token) pair and layer: one dot product of
        index_head_dim per index head."""
        return 2 * self.index_heads * self.index_head_dim if self.is_sparse_attention else 0

    def attended_tokens(self, context: int) -> int:
        """Cached tokens a decode query's main attention reads: all of them, or DSA's top-k."""
        return min(self.index_topk, context) if self.is_sparse_attention else context

    def kv_bytes_per_token_layer(self, tp: int = 1) -> int:
        """One attention layer's K and V for one token on one of `tp` ranks (GQA: the KV heads
        are split across ranks, replicated when there are fewer of them than ranks)."""
        return 2 * max(1, self.kv_heads // tp) * self.head_dim * self.dtype_bytes

    @property
    def mha_kv_bytes_per_token(self) -> int:
        """What the cache would be if every query head had its own K and V."""
        return 2 * self.attention_layers * self.heads * self.head_dim * self.dtype_bytes
