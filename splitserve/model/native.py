"""Builds and loads the compiled CPU kernels (csrc/*.cpp), once per process.

The engine loads them while it starts (LLMEngine, before any part answers /health), never
on a request; other callers (tests, benchmarks on bare ops) load them at their first op.
They are compiled on the user's machine (a C++ compiler and ninja, which comes with the
`ninja` dependency; about 20-30 s once) into `<root>/<name>/<name>.so`, where the root is
TORCH_EXTENSIONS_DIR, else torch's own cache folder (~/.cache/torch_extensions/py311_cpu),
and the name carries a hash of what the library depends on: the sources, the flags, the
torch and Python versions, the CPU's features. Two versions of the package never build
over each other's library.

No lock a dead process can keep: a process that finds no library builds in a private
folder beside it (`<name>.build-<pid>-<random>`, native_builder.py) and renames the
finished library into place. Its builder holds an flock on a file there, which the kernel
drops when the builder dies, however it dies: others wait for a running build (`up`
starts its engines side by side) and ignore a dead one, whose folder the next process
removes. Waiting and building each have a time limit (SPLITSERVE_NATIVE_BUILD_TIMEOUT_S,
default 600 s). Where the kernels cannot be built or loaded, or with SPLITSERVE_NATIVE_OPS=0,
the PyTorch references in ops.py run instead: same results, slower.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitserve.model.native_builder import kill_session

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "cpu_ops.cpp",
    CSRC / "prefill_attention.cpp",
    CSRC / "quant_matmul.cpp",
    CSRC / "quant_matmul_k.cpp",
    CSRC / "gemv_bf16.cpp",
    CSRC / "compiled_layers.cpp",
)
HEADERS = (CSRC / "quant_common.h",)  # included by the sources: part of what the library depends on
# registered by each source: the library is whole
OPS = ("argmax_rows", "prefill_attention", "quant_linear", "quant_linear_k", "gemv_bf16", "compiled_layers")
DISABLE_ENV = "SPLITSERVE_NATIVE_OPS"
BUILD_TIMEOUT_ENV = "SPLITSERVE_NATIVE_BUILD_TIMEOUT_S"
DEFAULT_BUILD_TIMEOUT_S = 600.0  # a fresh build took 108 s on 2 cores under a load of 6
# -march=native: the kernels are built on the machine that runs them, so they use its
# vector units (avx512 and avx512_bf16 where present). -fopenmp: at::parallel_for is
# inlined into the extension; the OpenMP runtime is torch's own libgomp.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_FOLDER_MARK = ".build-"  # <name>.build-<pid>-<random>: one builder's private folder
BUILDER_FLOCK = "builder.flock"  # not `lock`: torch's own lock file in the same folder
WAIT_POLL_S = 0.2
LOG_TAIL_CHARS = 3000


class NativeBuildError(RuntimeError):
    """The kernels could not be built: the message names the build's folder and log."""


def build_timeout_s() -> float:
    text = os.environ.get(BUILD_TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        timeout = float(text)
    except ValueError:
        timeout = 0.0
    if not timeout > 0:
        raise ValueError(f"{BUILD_TIMEOUT_ENV} must be a positive number of seconds, not {text!r}")
    return timeout


def extensions_root() -> Path:
    """TORCH_EXTENSIONS_DIR, else the folder torch builds its CPU extensions under
    (`cpp_extension.get_default_build_root()`, the user's cache folder, worked out here:
    importing cpp_extension imports setuptools, ~0.25 s of every engine's start)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(os.path.realpath(Path(cache) / "torch_extensions"))
    return root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for): a cache folder shared by
    machines with other CPUs never hands one a library it cannot run."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return f"{platform.machine()} {platform.processor()}"


def library_path() -> Path:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, sys.version, cpu_features()):
        digest.update(part.encode())
    name = f"splitserve_cpu_ops_{digest.hexdigest()[:12]}"
    return extensions_root() / name / f"{name}.so"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def build_folders(library: Path) -> list[Path]:
    """The private build folders of this library's builders, live or dead."""
    return sorted(library.parent.parent.glob(f"{library.stem}{BUILD_FOLDER_MARK}*"))


def builder_alive(folder: Path) -> bool:
    """Whether the builder of this folder still runs: it holds an flock on BUILDER_FLOCK,
    which the kernel drops when it dies, however it dies."""
    try:
        fd = os.open(folder / BUILDER_FLOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_dead_builds(root: Path) -> None:
    """Remove the build folders whose process is gone (killed mid-build); a failed
    build's folder stays, for its log, while the process that asked for it runs."""
    for folder in root.glob(f"splitserve_cpu_ops_*{BUILD_FOLDER_MARK}*"):
        pid_text = folder.name.rpartition(BUILD_FOLDER_MARK)[2].partition("-")[0]
        if pid_text.isdigit() and not process_alive(int(pid_text)) and not builder_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)


def wait_for_other_builders(library: Path, timeout_s: float) -> None:
    """While another process's builder runs (`up` starts engines side by side), wait for
    its library rather than compile the same one beside it; NativeBuildError past the limit."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while not library.exists():
        running = [folder for folder in build_folders(library) if builder_alive(folder)]
        if not running:
            return
        if not logged:
            logger.info("waiting for another process's build of the compiled CPU kernels in %s", running[0])
            logged = True
        if time.monotonic() > deadline:
            raise NativeBuildError(
                f"waited longer than {timeout_s:g} s ({BUILD_TIMEOUT_ENV}) for another process's "
                f"build of the compiled CPU kernels in {running[0]}"
            )
        time.sleep(WAIT_POLL_S)


def builder_env() -> dict[str, str]:
    env = dict(os.environ)
    if shutil.which("ninja") is None:  # torch looks on PATH; a venv's bin/ often is not
        import ninja

        env["PATH"] = ninja.BIN_DIR + os.pathsep + env.get("PATH", "")
    return env


def log_tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return ""


def build_library(library: Path, timeout_s: float) -> None:
    """Compile the kernels into a private folder beside `library` and rename the result
    into place (native_builder.py); NativeBuildError when it fails or passes the limit.
    A failed build's folder is kept for its log until the next process's clean-up."""
    library.parent.mkdir(parents=True, exist_ok=True)
    name = library.stem
    build_dir = Path(
        tempfile.mkdtemp(prefix=f"{name}{BUILD_FOLDER_MARK}{os.getpid()}-", dir=library.parent.parent)
    )
    # held by the builder (inherited, closed here): the kernel releases it when the builder
    # dies, so other processes tell a running build from a dead one without trusting pids
    flock_fd = os.open(build_dir / BUILDER_FLOCK, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(flock_fd, fcntl.LOCK_EX)
    log = build_dir / "build.log"
    spec = {
        "name": name,
        "sources": [str(source) for source in SOURCES],
        "cflags": list(CFLAGS),
        "ldflags": list(LDFLAGS),
        "build_dir": str(build_dir),
        "built": str(build_dir / library.name),
        "library": str(library),
        "parent_pid": os.getpid(),
        "timeout_s": timeout_s,
    }
    try:
        with open(log, "wb") as log_file:
            builder = subprocess.Popen(
                [sys.executable, "-m", "splitserve.model.native_builder", json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the session (ninja, the compilers) is killed as one
                pass_fds=(flock_fd,),
                env=builder_env(),
            )
    finally:
        os.close(flock_fd)
    try:
        returncode = builder.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NativeBuildError(
            f"building the compiled CPU kernels in {build_dir} took longer than {timeout_s:g} s "
            f"({BUILD_TIMEOUT_ENV}) and was stopped; its log: {log}"
        ) from None
    finally:
        if builder.poll() is None:
            kill_session(builder.pid)  # its own session: the builder, ninja, the compilers
            builder.wait()
    if returncode != 0 or not library.exists():
        raise NativeBuildError(
            f"building the compiled CPU kernels in {build_dir} failed (exit {returncode}); "
            f"the end of its log {log}:\n{log_tail(log)}"
        )
    shutil.rmtree(build_dir, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def load_cpu_ops() -> bool:
    """Build (when no process has yet) and load the kernels as torch.ops.splitserve_cpu.*;
    True when they are registered. Once per process; ValueError for a bad time limit."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    timeout_s = build_timeout_s()
    library = library_path()
    try:
        remove_dead_builds(library.parent.parent)
        wait_for_other_builders(library, timeout_s)
        if not library.exists():
            started = time.monotonic()
            logger.info("building the compiled CPU kernels (once, up to %g s): %s", timeout_s, library)
            build_library(library, timeout_s)
            logger.info("built the compiled CPU kernels in %.1f s", time.monotonic() - started)
        torch.ops.load_library(str(library))
    except Exception as exc:  # no compiler, no ninja, a failed or stopped build: fall back
        logger.warning("compiled CPU kernels unavailable (%s); using the PyTorch reference ops", exc)
        return False
    logger.info("compiled CPU kernels loaded: %s", library)
    return all(hasattr(torch.ops.splitserve_cpu, op) for op in OPS)


def use_cpu_ops(tensor: torch.Tensor) -> bool:
    """Whether an op on this tensor runs the compiled CPU kernel (CUDA runs the reference)."""
    return tensor.device.type == "cpu" and load_cpu_ops()
