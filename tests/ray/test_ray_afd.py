"""`splitserve up --ray --afd 1:1` on a local Ray cluster: the FFN daemon as the `ffn`
tier beside the decode tier's attention engine (docs/ray.md, "FFN tier"). About 30-50 s on
the shared 2-core CI machine, past what the suite affords one test: it runs only with
SPLITSERVE_RAY_AFD_TEST=1 (tests/ray/test_ray_config.py checks the plan, the commands
and the deployment options without a cluster)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from tests.conftest import free_port, running_server
from tests.ray.ray_helpers import APP, app_replicas, workers
from tests.ray.test_ray_deploy import deployed_token_ids, splitserve
from tests.router.test_pd_proxy import chat_token_ids, chats, metric

pytestmark = pytest.mark.skipif(
    os.environ.get("SPLITSERVE_RAY_AFD_TEST") != "1", reason="opt-in: SPLITSERVE_RAY_AFD_TEST=1"
)


@pytest.fixture(scope="module")
def tiny_moe() -> Iterator[str]:
    """The tiny Qwen3-MoE, in a directory of this module's own (as `tiny_model`)."""
    directory = tempfile.mkdtemp(prefix="splitserve-ray-moe-")
    try:
        spec = TinyModelSpec(arch="qwen3_moe", layers=2, dtype="bfloat16")
        yield str(write_tiny_model(Path(directory), spec))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_up_ray_afd_runs_the_ffn_daemon_as_a_tier_beside_the_attention_engines(
    cluster, tiny_moe, secrets_env
):
    """`up --ray --afd 1:1 --prefill 0`: the ffn tier's replica runs the FFN daemon, the
    decode tier's replica an attention engine started with the daemon's address (asked of
    the ffn deployment); the greedy answers are `serve`'s, the daemon registers with no
    router pool, and on one host (`--afd-transport auto`) the layers go through shared
    memory."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["up", tiny_moe, "--ray", cluster, "--ray-app-name", APP, "--port", str(port), "--prefill", "0"]
    args += ["--afd", "1:1", "--num-blocks", "256", "--max-model-len", "1024"]
    args += ["--ray-tier", "render:num_cpus=0.5", "--ray-tier", "decode:num_cpus=0.5"]
    args += ["--ray-tier", "ffn:num_cpus=0.5"]
    from ray import serve

    serve.shutdown()  # forget the controller an earlier test's `down` stopped (as above)
    up = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **secrets_env},
    )
    serve_port = free_port()
    try:
        with running_server(
            ["serve", tiny_moe, "--port", str(serve_port), "--num-blocks", "256", "--max-model-len", "1024"],
            serve_port,
        ) as ref:
            stdout, stderr = up.communicate(timeout=240)
            assert up.returncode == 0, stdout + stderr
            messages = chats()[:3]
            expected = asyncio.run(chat_token_ids(ref, messages))
        assert asyncio.run(deployed_token_ids(base, messages)) == expected
        members = workers()
        assert sorted(m["role"] for m in members) == ["decode", "render"]  # the daemon: no pool
        assert any("#ffn#" in name for name in app_replicas())
        (decode,) = [m["url"] for m in members if m["role"] == "decode"]
        token_auth = {"Authorization": f"Bearer {secrets_env['SPLITSERVE_INTERNAL_TOKEN']}"}
        text = httpx.get(f"{decode}/metrics", headers=token_auth, timeout=10).text
        assert metric(text, "splitserve_afd_step_bytes_sent_count") > 0
        assert metric(text, "splitserve_afd_shm_layers_total") > 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        splitserve("down", "--ray", cluster, "--ray-app-name", APP)
