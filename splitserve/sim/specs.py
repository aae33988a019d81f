"""Hardware and model specs: built-in GPUs and models, and models read from a HF config.json
(the model's shape itself, `ModelSpec`, is model_spec.py's)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from splitserve.sim.mamba import MOE, MambaSpec, hybrid_from_hf_config
from splitserve.sim.model_spec import ModelSpec, SpecError


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
        # Huawei's two-die NPU as commonly reported (about 750 TFLOP/s BF16, 128 GB at
        # 3.2 TB/s, HCCS between chips): approximate, the plugin's AFD benchmark ran on it
        GPUSpec("Ascend-910C", 752e12, 3.2e12, 128e9, 196e9, 25e9),
        # one of its two dies, half of each figure: what vLLM-Ascend runs as one rank (an
        # Atlas A3 node is "64G x 16", 16 dies of 64 GB), and what the AFD plugin's
        # DeepSeek-V3.2 recipe counts ("tokens/s/die", 64 dies for EP64). Its 98 GB/s link is
        # near the 103-107 GB/s DeepEP-Ascend's normal kernels reach among 16 ranks
        # (sgl-project/sgl-kernel-npu README)
        GPUSpec("Ascend-910C-die", 376e12, 1.6e12, 64e9, 98e9, 12.5e9),
    )
}


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

# NVIDIA Nemotron-3-Nano-30B-A3B (nemotron_h): 23 Mamba2, 23 MoE (128 experts, top-6, one
# shared expert twice as wide, relu^2) and 6 attention layers (2 KV heads).
NEMOTRON_3_NANO = ModelSpec(
    "Nemotron-3-Nano-30B-A3B",
    52,
    2688,
    32,
    2,
    128,
    1856,
    131072,
    experts=128,
    experts_per_token=6,
    shared_experts=2,
    moe_intermediate=1856,
    pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    mamba=MambaSpec(heads=64, head_dim=64, state=128, groups=8),
    mlp_matrices=2,
)
# The seed's cut-points example ("Nemotron-3-Nano, per GPU at TP=2"): 48 SSM heads and 4 KV
# heads per GPU, i.e. 96 and 8 in the model, and a convolution buffer over the x channels
# only (3,072 per GPU, as if B and C had no groups). Everything else as the real model.
NEMOTRON_SEED_EXAMPLE = replace(
    NEMOTRON_3_NANO,
    name="Nemotron-3-Nano-seed",
    kv_heads=8,
    mamba=MambaSpec(heads=96, head_dim=64, state=128, groups=0),
)
# DeepSeek-V3.2 (-Exp): DeepSeek-V3's shapes plus DSA, whose indexer has 64 heads of 128 and
# keeps the top 2048 tokens (config.json's index_n_heads, index_head_dim, index_topk; the
# inference code's ModelArgs defaults). The plugin's published AFD benchmark ran it.
DEEPSEEK_V3_2 = replace(
    MODELS["DeepSeek-V3"], name="DeepSeek-V3.2", index_heads=64, index_head_dim=128, index_topk=2048
)
MODELS.update({m.name: m for m in (NEMOTRON_3_NANO, NEMOTRON_SEED_EXAMPLE, DEEPSEEK_V3_2)})


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
    Qwen-MoE, Mixtral, DeepSeek-V2/V3 MLA, Nemotron-H hybrids; a multimodal config's
    `text_config`)."""
    cfg = config.get("text_config") or config
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    dtype_bytes = _DTYPE_BYTES.get(dtype, 2)
    try:
        hybrid = hybrid_from_hf_config(cfg, dtype_bytes)
    except ValueError as exc:
        raise SpecError(str(exc)) from exc
    pattern, mamba = hybrid if hybrid else ("", None)
    try:
        layers = int(cfg["num_hidden_layers"]) if "num_hidden_layers" in cfg or not pattern else len(pattern)
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
    if pattern and MOE not in pattern:
        experts = 0  # a dense Nemotron-H config still carries MoE defaults
    fields: dict = {
        "name": str(config.get("_name_or_path") or name),
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate": int(cfg.get("intermediate_size") or 4 * hidden),
        "vocab": vocab,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        "dtype_bytes": dtype_bytes,
        "pattern": pattern,
        "mamba": mamba,
        # relu^2 MLPs (Nemotron-H) have no gate matrix
        "mlp_matrices": 2 if str(cfg.get("mlp_hidden_act", "")) == "relu2" else 3,
    }
    if experts:
        shared = int(cfg.get("n_shared_experts") or 0)
        if not (cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")):
            raise SpecError(
                "config.json: a mixture-of-experts model needs moe_intermediate_size (its experts' width)"
            )
        moe_ff = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
        if cfg.get("moe_shared_expert_intermediate_size"):  # Nemotron-H: shared experts of their own width
            shared = round(max(shared, 1) * int(cfg["moe_shared_expert_intermediate_size"]) / moe_ff)
        elif not shared and cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one wide shared expert
            shared = max(1, int(cfg["shared_expert_intermediate_size"]) // moe_ff)
        fields.update(
            experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 1),
            shared_experts=shared,
            moe_intermediate=moe_ff,
            dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        )
    if cfg.get("kv_lora_rank"):
        fields.update(
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or head_dim),
        )
    if cfg.get("index_topk"):  # DeepSeek sparse attention (deepseek_v32)
        fields.update(
            index_heads=int(cfg.get("index_n_heads") or 0),
            index_head_dim=int(cfg.get("index_head_dim") or 0),
            index_topk=int(cfg["index_topk"]),
        )
    if min(layers, hidden, heads, kv_heads, head_dim, vocab) <= 0:
        raise SpecError("config.json: sizes must be positive")
    return ModelSpec(**fields)
