"""Where an engine runs and in which dtype."""

from __future__ import annotations

import logging

import torch

from splitserve.model.decoder_config import BF16_WHERE_NATIVE

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[name]


def cpu_has_native_half_matmul(dtype: torch.dtype) -> bool:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if dtype == torch.bfloat16:
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return bool(caps.get("avx512_fp16") or caps.get("amx_fp16"))


def choose_dtype(requested: str | None, config_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype asked for, else the one config.json names. On a CPU without native
    bf16/fp16 matmul those matmuls are emulated (~5x slower than float32 here): say so,
    and let the operator choose `dtype="float32"`, rather than silently change precision.

    A config that names `BF16_WHERE_NATIVE` (a GGUF file, whose dequantized weights
    are exact in float32) is served in bfloat16 where that is native and float32 where
    bf16 would be emulated."""
    if requested is None and config_dtype == BF16_WHERE_NATIVE:
        native = device.type != "cpu" or cpu_has_native_half_matmul(torch.bfloat16)
        return torch.bfloat16 if native else torch.float32
    dtype = resolve_dtype(requested or config_dtype)
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_native_half_matmul(dtype):
        logger.warning(
            "%s matmuls are emulated on this CPU and run several times slower than float32; "
            "pass dtype float32 (--dtype float32) for speed",
            dtype,
        )
    return dtype


def choose_kv_cache_dtype(requested: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the one asked for, or for `auto` the compute dtype. A 16-bit
    cache under float32 activations (a quantized GGUF model's: half the bytes decode
    attention reads, as llama.cpp's f16 cache) is asked for, not the default: it flips the
    demo model's coin-flip answer to "What is the capital of France?" (docs/engine-kernels.md).
    A cache is the compute dtype or, under float32 activations, 16-bit: the attention
    kernels read nothing else (ValueError)."""
    if requested == "auto":
        return compute_dtype
    dtype = resolve_dtype(requested)
    if dtype != compute_dtype and compute_dtype != torch.float32:
        raise ValueError(
            f"--kv-cache-dtype {requested} under {dtype_name(compute_dtype)} activations: the KV cache "
            "is the compute dtype, or bfloat16/float16 under float32 activations"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_device() -> torch.device:
    """cuda when present, else cpu (ModelConfig.device None)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
