"""The models the engine benchmarks run, the dtype splitserve computes in, and the CPU
flags that decide it.

- `bench`: the bench model of PEERS.md (Qwen3-shaped, 8 layers, hidden 512, 8/4 heads,
  32k vocab, bf16 weights);
- `smollm2`: the SmolLM2-135M-Instruct shape (Llama, 30 layers, hidden 576, 9 q / 3 kv
  heads, head_dim 64, intermediate 1536, 49,152 vocab, tied embeddings, bf16), random
  weights;
- or any model directory (e.g. the real SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH_MODEL_FLAGS = [
    "--arch", "qwen3", "--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4",
    "--vocab", "32768", "--dtype", "bfloat16",
]  # fmt: skip
SMOLLM2_SHAPE_FLAGS = [
    "--arch", "llama", "--layers", "30", "--hidden", "576", "--heads", "9", "--kv-heads", "3",
    "--head-dim", "64", "--intermediate", "1536", "--vocab", "49152", "--max-position", "8192",
    "--dtype", "bfloat16",
]  # fmt: skip
# a hybrid beside the bench model, of its width and depth: 4 Mamba2, 2 attention, 2 MLP layers
HYBRID_BENCH_FLAGS = [
    "--arch", "nemotron_h", "--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4",
    "--vocab", "32768", "--dtype", "bfloat16", "--pattern", "M*M-M*M-",
]  # fmt: skip
MODELS_HOME = Path(os.environ.get("SPLITSERVE_HOME", Path.home() / ".cache" / "splitserve"))
DEFAULT_MODEL_DIR = MODELS_HOME / "bench-qwen3-8l"
SMOLLM2_SHAPE_DIR = MODELS_HOME / "bench-smollm2-shape"


def _build(directory: Path, flags: list[str]) -> None:
    print(f"building {directory} ...", flush=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "splitserve.cli", "tiny-model", str(directory), *flags], check=True)


def ensure_bench_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    if not (directory / "model.safetensors").is_file():
        _build(directory, BENCH_MODEL_FLAGS)
    return directory


def ensure_long_bench_model(max_position: int) -> Path:
    """The bench model's shape with a longer context (`max_position` tokens), its own directory."""
    directory = DEFAULT_MODEL_DIR.with_name(f"{DEFAULT_MODEL_DIR.name}-{max_position}")
    if not (directory / "model.safetensors").is_file():
        _build(directory, [*BENCH_MODEL_FLAGS, "--max-position", str(max_position)])
    return directory


def ensure_hybrid_bench_model(max_position: int) -> Path:
    """The hybrid (Nemotron-H) bench model holding `max_position` tokens, its own directory."""
    directory = MODELS_HOME / f"bench-nemotron-h-8l-{max_position}"
    if not (directory / "model.safetensors").is_file():
        _build(directory, [*HYBRID_BENCH_FLAGS, "--max-position", str(max_position)])
    return directory


def ensure_smollm2_shape(directory: Path = SMOLLM2_SHAPE_DIR) -> Path:
    config = directory / "config.json"
    if not (directory / "model.safetensors").is_file():
        _build(directory, SMOLLM2_SHAPE_FLAGS)
        # SmolLM2 ties lm_head to the embedding and its checkpoint has no lm_head
        from safetensors.torch import load_file, save_file

        weights_file = directory / "model.safetensors"
        weights = load_file(weights_file)
        del weights["lm_head.weight"]
        save_file(weights, weights_file, metadata={"format": "pt"})
        raw = json.loads(config.read_text())
        raw["tie_word_embeddings"] = True
        config.write_text(json.dumps(raw, indent=2))
    return directory


def resolve_bench_model(name: str) -> Path:
    if name == "bench":
        return ensure_bench_model()
    if name == "smollm2":
        return ensure_smollm2_shape()
    return Path(name)


def compute_dtype() -> str:
    """bf16 where this CPU has native bf16 matmul, else float32 over the bf16 weights
    (emulated bf16 matmul runs several times slower than float32)."""
    import torch

    from splitserve.engine.device import cpu_has_native_half_matmul

    return "bfloat16" if cpu_has_native_half_matmul(torch.bfloat16) else "float32"


def cpu_isa_flags() -> str:
    """The vector-ISA flags of this CPU that decide matmul speed (from /proc/cpuinfo)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return " ".join(f for f in wanted if f in present) or "none of " + " ".join(wanted)
    except OSError:
        pass
    return "unknown"
