"""The compiled CPU kernels are built while a part starts, by a build that a killed process
cannot wedge (issue 21): a `serve` SIGKILLed mid-build leaves no builder running and the
next `serve` builds, starts and answers; a stale torch `lock` never blocks; a build past
its time limit is stopped with an error naming its folder, and the references run.

One fresh build in the whole file (~30-60 s on 2 cores): the kill test's second `serve`
makes it, into a TORCH_EXTENSIONS_DIR the module shares."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.model.native import (
    BUILD_TIMEOUT_ENV,
    BUILDER_FLOCK,
    builder_alive,
    extensions_root,
    library_path,
)
from tests.conftest import free_port, running_server

BUILD_STARTUP_S = 600  # a fresh build on 2 shared cores, with a serve's start-up around it
LOAD_KERNELS = (
    "import logging; logging.basicConfig(level='INFO')\n"
    "from splitserve.model.native import load_cpu_ops; print(load_cpu_ops())"
)

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the builder's processes in /proc")


@pytest.fixture(scope="module")
def extensions_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch-extensions").resolve()


def build_folders(root: Path) -> list[Path]:
    return sorted(root.glob("splitserve_cpu_ops_*.build-*"))


def libraries(root: Path) -> list[Path]:
    return sorted(root.glob("splitserve_cpu_ops_*/splitserve_cpu_ops_*.so"))


def processes_in(folder: Path) -> list[int]:
    """Live processes working in the folder (ninja, the compilers) or naming it (the builder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X"):
                continue
            working_there = os.readlink(entry / "cwd") == str(folder)
            if working_there or str(folder).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def load_kernels(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh process loading the kernels through the Python API, with its own time limit
    (a wedged load fails the test instead of hanging it)."""
    return subprocess.run(
        [sys.executable, "-c", LOAD_KERNELS],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root), **env},
        capture_output=True,
        text=True,
        timeout=BUILD_STARTUP_S,
    )


@pytest.mark.timeout(3 * BUILD_STARTUP_S)
def test_serve_killed_mid_build_leaves_nothing_that_stops_the_next_one(
    tiny_model, extensions_dir, tmp_path, monkeypatch
):
    # the reported wedge: a torch `lock` left by a dead holder in the library's folder
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir))
    library = library_path()
    library.parent.mkdir()
    (library.parent / "lock").touch()
    port = free_port()
    with open(tmp_path / "killed-serve.log", "wb") as log:
        killed = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "serve", tiny_model, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir)},
            start_new_session=True,
        )
    try:
        # mid-build: torch has written the ninja file into the private folder, compiling next
        def compiling() -> bool:
            return any((folder / "build.ninja").exists() for folder in build_folders(extensions_dir))

        wait_for(lambda: killed.poll() is not None or compiling(), BUILD_STARTUP_S, "the build to start")
        assert killed.poll() is None, (tmp_path / "killed-serve.log").read_text()
        (running_build,) = build_folders(extensions_dir)
        assert builder_alive(running_build)  # what other processes would wait for
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
    (dead_build,) = build_folders(extensions_dir)
    assert not libraries(extensions_dir)  # killed before it finished
    wait_for(lambda: not processes_in(dead_build), 30, "the dead serve's builder and compilers to end")
    # its flock goes with it (nobody waits for it): a process mid-exit has lost its command
    # line (its memory goes first) a moment before its files, so this too is awaited
    wait_for(lambda: not builder_alive(dead_build), 30, "the dead builder's flock to be released")

    port = free_port()
    env = {"TORCH_EXTENSIONS_DIR": str(extensions_dir)}
    with running_server(
        ["serve", tiny_model, "--port", str(port)], port, timeout=BUILD_STARTUP_S, env=env
    ) as base:
        assert libraries(extensions_dir) == [library]  # built while starting, before /health said 200
        assert not build_folders(extensions_dir)  # the dead build's folder cleaned up, its own removed
        response = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4


def test_stale_lock_files_do_not_block_loading(extensions_dir):
    """Beside a library in place (the kill test's; built here if run alone): a torch `lock`
    in its folder and a dead builder's folder holding one change nothing."""
    if not libraries(extensions_dir):
        assert load_kernels(extensions_dir).stdout.strip() == "True"
    (library,) = libraries(extensions_dir)
    (library.parent / "lock").touch()
    finished = subprocess.Popen(["true"])
    finished.wait()  # its process id names a builder that is no longer running
    dead_build = extensions_dir / f"{library.parent.name}.build-{finished.pid}-x"
    dead_build.mkdir()
    (dead_build / "lock").touch()

    result = load_kernels(extensions_dir)
    assert result.stdout.strip() == "True", result.stderr
    assert "building" not in result.stderr and "waiting" not in result.stderr
    assert not dead_build.exists()


@contextlib.contextmanager
def running_builder(library: Path) -> Iterator[Path]:
    """Another process's build in progress, as loaders see it: its folder, whose
    builder.flock is held (here by the test, for as long as it likes)."""
    folder = library.parent.parent / f"{library.stem}.build-{os.getpid()}-test"
    folder.mkdir()
    with open(folder / BUILDER_FLOCK, "wb") as flock_file:
        fcntl.flock(flock_file, fcntl.LOCK_EX)
        yield folder
    shutil.rmtree(folder)


def start_loader(root: Path, log: Path, **env: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-c", LOAD_KERNELS],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root), **env},
        )


def test_a_loader_waits_for_a_running_build_then_loads_its_library(extensions_dir, tmp_path):
    """`up` starts its engines side by side: one builds, the others wait for its library."""
    if not libraries(extensions_dir):
        assert load_kernels(extensions_dir).stdout.strip() == "True"
    (library,) = libraries(extensions_dir)
    aside = tmp_path / library.name
    os.replace(library, aside)
    log = tmp_path / "loader.log"
    try:
        with running_builder(library):
            loader = start_loader(extensions_dir, log)
            try:
                wait_for(lambda: "waiting for another process's build" in log.read_text(), 120, "the wait")
                os.replace(aside, library)  # what the running build does when it finishes
                assert loader.wait(timeout=120) == 0
            finally:
                if loader.poll() is None:
                    loader.kill()
                    loader.wait()
    finally:
        if aside.exists():
            os.replace(aside, library)
    output = log.read_text()
    assert output.splitlines()[-1] == "True" and "building" not in output, output


def test_waiting_for_a_running_build_has_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    library = library_path()
    with running_builder(library) as folder:
        result = load_kernels(tmp_path, **{BUILD_TIMEOUT_ENV: "1"})
    assert result.stdout.strip() == "False"  # the references run
    assert f"waited longer than 1 s ({BUILD_TIMEOUT_ENV})" in result.stderr
    assert str(folder) in result.stderr


def test_build_past_its_time_limit_is_stopped_and_the_references_run(tmp_path):
    result = load_kernels(tmp_path, **{BUILD_TIMEOUT_ENV: "0.5"})
    assert result.stdout.strip() == "False"  # the process goes on, on the PyTorch references
    assert "took longer than 0.5 s" in result.stderr and BUILD_TIMEOUT_ENV in result.stderr
    (stuck,) = build_folders(tmp_path)
    assert str(stuck) in result.stderr  # the error names the folder of the stuck build
    assert (stuck / "build.log").exists()
    assert not processes_in(stuck)  # its builder was killed with everything it started
    assert not libraries(tmp_path)


def test_bad_time_limit_is_a_clear_cli_error(tiny_model, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "serve", tiny_model, "--port", str(free_port())],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), BUILD_TIMEOUT_ENV: "soon"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"{BUILD_TIMEOUT_ENV} must be a positive number of seconds, not 'soon'" in result.stderr
    assert not list(tmp_path.iterdir())  # nothing was built


@pytest.mark.parametrize("cache_home", [None, "xdg-cache"])
def test_the_default_extensions_folder_is_torchs(monkeypatch, tmp_path, cache_home):
    """Without TORCH_EXTENSIONS_DIR the kernels live where torch's own builds do."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    if cache_home:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / cache_home))
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert extensions_root().parent == Path(get_default_build_root())
    assert extensions_root().name == f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
