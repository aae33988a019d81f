"""What a MODEL argument resolves to: GGUF files, directories holding one, model
directories, and Hugging Face IDs through a pre-populated Hugging Face cache, offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from splitserve.model_files.resolve import ModelNotFoundError, ResolvedModel, resolve_model
from tests.conftest import free_port, running_server
from tests.model.gguf_files import GGUF_SPEC, write_tiny_gguf

REVISION = "0123456789abcdef0123456789abcdef01234567"


def hugging_face_cache(root: Path, repo_id: str, model_dir: str) -> Path:
    """The standard Hugging Face cache layout (as `hf download` leaves it) for one repo."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_gguf_files_and_directories(tmp_path, tiny_model):
    (tmp_path / "one").mkdir()
    gguf = write_tiny_gguf(tmp_path / "one" / "tiny.Q8_0.gguf", GGUF_SPEC["qwen2"], "Q8_0")
    assert resolve_model(str(gguf)) == ResolvedModel(str(gguf), "tiny.Q8_0")
    assert resolve_model(str(gguf.parent)) == ResolvedModel(str(gguf), "tiny.Q8_0")  # a folder holding one
    assert resolve_model(tiny_model) == ResolvedModel(tiny_model, Path(tiny_model).name)
    shutil.copy(gguf, gguf.with_name("other.gguf"))
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        resolve_model(str(gguf.parent))
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_model(str(Path(tiny_model) / "config.json"))
    with pytest.raises(ModelNotFoundError, match="not a model directory"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="neither a GGUF file"):
        resolve_model("./no/such/thing.gguf")


def test_hugging_face_id_from_the_cache_offline(tmp_path, tiny_model):
    cache = tmp_path / "hub"
    hugging_face_cache(cache, "acme/tiny-chat", tiny_model)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    port = free_port()
    with running_server(
        ["serve", "acme/tiny-chat", "--port", str(port), "--num-blocks", "64"], port, env=env
    ) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["acme/tiny-chat"]
        reply = client.chat.completions.create(
            model="acme/tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert reply.usage.completion_tokens == 4
    missing = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "engine", "acme/not-cached", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert missing.returncode != 0
    assert "'acme/not-cached' is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in missing.stderr
