"""Attention-FFN disaggregation: an attention engine whose MoE layers run on an FFN daemon
(`splitserve engine --role ffn`) answers the collocated engine's greedy tokens, through the
engine API and the `engine --role attention` server; a daemon refuses a wrong token."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from splitserve.afd.ffn_connection import AfdError
from splitserve.config import AfdConfig
from splitserve.engine.llm import LLM, engine_config_from_kwargs
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from tests.conftest import free_port, running_server
from tests.engine.helpers import make_prompts

TOKEN = "afd-test-token"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = {"num_blocks": 64, "max_num_batched_tokens": 16}  # chunked prefill beside decodes


@contextlib.contextmanager
def ffn_daemon(model_dir: str, port: int, token: str | None, log_path) -> Iterator[subprocess.Popen]:
    args = [sys.executable, "-m", "splitserve.cli", "engine", model_dir, "--role", "ffn", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_ENV}
    if token is not None:
        env[INTERNAL_TOKEN_ENV] = token
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def bf16_moe(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen3_moe", layers=4, dtype="bfloat16")


@pytest.fixture(scope="module")
def daemon(bf16_moe, tmp_path_factory) -> Iterator[int]:
    port = free_port()
    with ffn_daemon(bf16_moe, port, TOKEN, tmp_path_factory.mktemp("ffn") / "ffn.log") as proc:
        yield port
        assert proc.poll() is None, "the FFN daemon died"


@pytest.fixture(scope="module")
def collocated(bf16_moe) -> tuple[list[list[int]], list[list[int]]]:
    prompts = make_prompts(2048, seed=5)
    return prompts, [r.token_ids for r in LLM(bf16_moe, **ENGINE).generate(prompts, GREEDY)]


def attention_llm(model_dir: str, port: int, microbatches: int = 2, transport: str = "auto") -> LLM:
    config = engine_config_from_kwargs(model_dir, **ENGINE)
    afd = AfdConfig("127.0.0.1", port, timeout_s=60.0, microbatches=microbatches, transport=transport)
    return LLM(config=dataclasses.replace(config, afd=afd))


def test_attention_engine_equals_the_collocated_one(bf16_moe, daemon, collocated, monkeypatch):
    """Batched (all prompts at once, chunked prefill beside decodes), with the decode
    steps as one batch and as two overlapped micro-batches: the collocated tokens."""
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    prompts, expected = collocated
    layers_sent = {}
    for microbatches, transport in ((1, "tcp"), (2, "shm")):
        llm = attention_llm(bf16_moe, daemon, microbatches, transport)
        runner = llm.engine.runner
        assert all(getattr(layer.mlp, "experts", None) is None for layer in runner.model.layers)  # none here
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        assert runner.ffn is not None and runner.ffn.bytes_sent > 0 and runner.ffn.bytes_received > 0
        assert (runner.ffn.shm_layers > 0) == (transport == "shm")
        assert not runner.ffn.in_flight
        layers_sent[microbatches] = runner.ffn.totals().layers
        llm.engine.shutdown()
    # the same steps; each decode step of several sequences sends every layer twice, a half each
    assert layers_sent[2] > layers_sent[1]


def test_a_wrong_or_missing_token_is_refused_and_the_daemon_keeps_serving(
    bf16_moe, daemon, collocated, monkeypatch
):
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "another-deployments-token")
    with pytest.raises(AfdError, match="not this deployment's internal token"):
        attention_llm(bf16_moe, daemon)
    monkeypatch.delenv(INTERNAL_TOKEN_ENV)
    with pytest.raises(AfdError, match="not this deployment's internal token"):
        attention_llm(bf16_moe, daemon)
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    prompts, expected = collocated
    assert [r.token_ids for r in attention_llm(bf16_moe, daemon).generate(prompts[:2], GREEDY)] == expected[
        :2
    ]


def test_engine_role_attention_serves_the_collocated_tokens(bf16_moe, collocated, tmp_path, monkeypatch):
    """The servers of an open loopback deployment (no token: the test polls /health
    without one); the attention engine waits at start-up for the daemon's HELLO."""
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    prompts, expected = collocated
    port, ffn_port = free_port(), free_port()
    args = ["engine", bf16_moe, "--port", str(port), "--num-blocks", "64", "--role", "attention"]
    args += ["--ffn-address", f"127.0.0.1:{ffn_port}"]
    with ffn_daemon(bf16_moe, ffn_port, None, tmp_path / "ffn.log"), running_server(args, port) as base:
        for prompt, tokens in zip(prompts[:3], expected[:3], strict=True):
            sampling = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
            body = {"token_ids": prompt, "sampling_params": sampling}
            response = httpx.post(f"{base}/inference/v1/generate", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == tokens
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "engine",
            bf16_moe,
            "--role",
            "attention",
            "--ffn-address",
            "nowhere",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--ffn-address HOST:PORT" in bad.stderr
