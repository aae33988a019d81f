"""Builds and loads the compiled CPU kernels (csrc/*.cpp) at first use.

The kernels are compiled on the user's machine with `torch.utils.cpp_extension` (a C++
compiler and ninja, which comes with the `ninja` dependency; about 20 s once, then cached
by torch under TORCH_EXTENSIONS_DIR). Where they cannot be built, or with SPLITSERVE_NATIVE_OPS=0, the
PyTorch references in ops.py run instead: same results, slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "cpu_ops.cpp", CSRC / "prefill_attention.cpp")
DISABLE_ENV = "SPLITSERVE_NATIVE_OPS"


@functools.lru_cache(maxsize=1)
def cpu_ops_available() -> bool:
    """True once the kernels are registered as torch.ops.splitserve_cpu.*."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # torch looks on PATH; a venv's bin/ often is not
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        # -march=native: the kernels are built on the machine that runs them, so they use
        # its vector units (avx512 and avx512_bf16 where present). -fopenmp: at::parallel_for
        # is inlined into the extension; the OpenMP runtime is torch's own libgomp. The name
        # carries the source's hash: torch builds each name in its own folder, so
        # two versions of the package (two checkouts, an upgrade beside a running server)
        # never rebuild over each other's library
        digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()[:12]
        load(
            name=f"splitserve_cpu_ops_{digest}",
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported platform: fall back
        logger.warning("compiled CPU kernels unavailable (%s); using the PyTorch reference ops", exc)
        return False
    return all(hasattr(torch.ops.splitserve_cpu, op) for op in ("argmax_rows", "prefill_attention"))


def use_cpu_ops(tensor: torch.Tensor) -> bool:
    """Whether an op on this tensor runs the compiled CPU kernel (CUDA runs the reference)."""
    return tensor.device.type == "cpu" and cpu_ops_available()
