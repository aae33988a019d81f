"""The bench model of PEERS.md (Qwen3-shaped, 8 layers, hidden 512, 8/4 heads, 32k vocab,
bf16 weights), shared by the engine benchmarks, and the dtype splitserve computes in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH_MODEL_FLAGS = [
    "--arch", "qwen3", "--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4",
    "--vocab", "32768", "--dtype", "bfloat16",
]  # fmt: skip
DEFAULT_MODEL_DIR = (
    Path(os.environ.get("SPLITSERVE_HOME", Path.home() / ".cache" / "splitserve")) / "bench-qwen3-8l"
)


def ensure_bench_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    if not (directory / "model.safetensors").is_file():
        print(f"building the bench model in {directory} ...", flush=True)
        directory.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "tiny-model", str(directory), *BENCH_MODEL_FLAGS],
            check=True,
        )
    return directory


def compute_dtype() -> str:
    """bf16 where this CPU has native bf16 matmul, else float32 over the bf16 weights
    (emulated bf16 matmul runs several times slower than float32)."""
    import torch

    from splitserve.engine.llm_engine import cpu_has_native_half_matmul

    return "bfloat16" if cpu_has_native_half_matmul(torch.bfloat16) else "float32"
