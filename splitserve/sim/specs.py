"""Hardware and model specs: built-in GPUs and models, and models read from a HF config.json.

Parameter counts follow the seed's convention: weight matrices only (biases and norms are
below 0.1% and left out), the input embedding is resident but not read per step, the output
head is read every step (and counted separately so a tied head is not counted twice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


class SpecError(ValueError):
    """An unknown or malformed GPU/model spec (the CLI turns it into a clear message)."""


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float  # device memory
    link_bw: float  # bytes/s per direction between GPUs of one instance (NVLink or PCIe)
    net_bw: float  # bytes/s per GPU between instances (the NIC or PCIe path KV takes)

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the roofline bends."""
        return self.peak_flops / self.mem_bw


# Datasheet figures (dense, no sparsity). net_bw: one 400 Gb/s NIC per GPU where the
# platform ships one, PCIe 4.0 x16 (~25 GB/s usable) for the L40S.
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("L40S", 362e12, 864e9, 48e9, 25e9, 25e9),
        GPUSpec("A100-80G", 312e12, 2039e9, 80e9, 300e9, 25e9),
        GPUSpec("H100-SXM", 989e12, 3.35e12, 80e9, 450e9, 50e9),
        GPUSpec("H200", 989e12, 4.8e12, 141e9, 450e9, 50e9),
        GPUSpec("B200", 2250e12, 7.7e12, 180e9, 900e9, 50e9),
    )
}


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

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    # ---- parameters -------------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        d, h = self.hidden, self.heads
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = d * self.q_lora_rank + self.q_lora_rank * h * qk if self.q_lora_rank else d * h * qk
            kv = d * (self.kv_lora_rank + self.qk_rope_dim)
            kv += self.kv_lora_rank * h * (self.qk_nope_dim + self.v_head_dim)
            return q + kv + h * self.v_head_dim * d
        hd = self.head_dim
        return d * h * hd + 2 * d * self.kv_heads * hd + h * hd * d

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def layer_params(self) -> int:
        """All non-embedding weights of the decoder stack (every expert counted)."""
        dense = (self.layers - self.moe_layers) * (self.attn_params_per_layer + self.dense_mlp_params)
        moe_mlp = (self.experts + self.shared_experts) * self.expert_params + self.hidden * self.experts
        return dense + self.moe_layers * (self.attn_params_per_layer + moe_mlp)

    @property
    def active_layer_params(self) -> int:
        """Non-embedding weights one token multiplies through (routed top-k + shared experts)."""
        if not self.is_moe:
            return self.layer_params
        dense = (self.layers - self.moe_layers) * (self.attn_params_per_layer + self.dense_mlp_params)
        active = (self.experts_per_token + self.shared_experts) * self.expert_params
        return dense + self.moe_layers * (self.attn_params_per_layer + active + self.hidden * self.experts)

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
        if self.is_mla:
            return 2 * self.layers * self.heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        return 4 * self.layers * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        if self.is_mla:  # one compressed latent + the shared rope key per layer
            return self.layers * (self.kv_lora_rank + self.qk_rope_dim) * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def mha_kv_bytes_per_token(self) -> int:
        """What the cache would be if every query head had its own K and V."""
        return 2 * self.layers * self.heads * self.head_dim * self.dtype_bytes


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
        ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec(
            "Qwen3-235B-A22B",
            94,
            4096,
            64,
            4,
            128,
            12288,
            151936,
            experts=128,
            experts_per_token=8,
            moe_intermediate=1536,
        ),
        ModelSpec(
            "DeepSeek-V3",
            61,
            7168,
            128,
            128,
            192,
            18432,
            129280,
            experts=256,
            experts_per_token=8,
            shared_experts=1,
            moe_intermediate=2048,
            dense_layers=3,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_dim=64,
            qk_nope_dim=128,
            v_head_dim=128,
        ),
    )
}


def _lookup(table: dict, name: str, what: str):
    for key, value in table.items():
        if key.lower() == name.lower():
            return value
    raise SpecError(f"unknown {what} {name!r}; known: {', '.join(table)} (or a path to a JSON file)")


def load_gpu(name_or_path: str) -> GPUSpec:
    """A built-in GPU by name, or a JSON file with GPUSpec's fields (e.g. a CPU host to calibrate)."""
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        data = _read_json(name_or_path)
        try:
            fields = {k: float(data[k]) for k in ("peak_flops", "mem_bw", "mem_bytes")}
            fields["link_bw"] = float(data.get("link_bw", fields["mem_bw"]))
            fields["net_bw"] = float(data.get("net_bw", fields["link_bw"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(
                f"{name_or_path}: a GPU spec needs numeric peak_flops, mem_bw, mem_bytes"
            ) from exc
        if min(fields.values()) <= 0:
            raise SpecError(f"{name_or_path}: GPU figures must be positive")
        return GPUSpec(name=str(data.get("name", Path(name_or_path).stem)), **fields)
    return _lookup(GPUS, name_or_path, "GPU")


def load_model(name_or_path: str) -> ModelSpec:
    """A built-in model by name, or a HF config.json (a file, or a directory holding one)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file() or "/" in name_or_path:
        return model_from_hf_config(_read_json(str(path)), name=path.parent.name or path.stem)
    return _lookup(MODELS, name_or_path, "model")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such file") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object")
    return data


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def model_from_hf_config(config: dict, name: str = "model") -> ModelSpec:
    """Read the fields that matter for cost from a transformers config (Llama/Qwen/Mistral,
    Qwen-MoE, Mixtral, DeepSeek-V2/V3 MLA; a multimodal config's `text_config`)."""
    cfg = config.get("text_config") or config
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg.get("vocab_size", config.get("vocab_size")))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(
            f"config.json lacks {exc}: need num_hidden_layers, hidden_size, num_attention_heads, vocab_size"
        ) from exc
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    spec = ModelSpec(
        name=str(config.get("_name_or_path") or name),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
        vocab=vocab,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
    )
    if experts:
        shared = int(cfg.get("n_shared_experts") or 0)
        moe_ff = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
        if not shared and cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one wide shared expert
            shared = max(1, int(cfg["shared_expert_intermediate_size"]) // moe_ff)
        spec = replace(
            spec,
            experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 1),
            shared_experts=shared,
            moe_intermediate=moe_ff,
            dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        )
    if cfg.get("kv_lora_rank"):
        spec = replace(
            spec,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or head_dim),
        )
    if min(layers, hidden, heads, kv_heads, head_dim, vocab) <= 0:
        raise SpecError("config.json: sizes must be positive")
    return spec
