"""Dual micro-batch overlap over a model with a dense layer among the sparse ones
(`mlp_only_layers`): the dense MLP runs on the attention side between the halves' sends,
the tokens are the collocated engine's at 1 and 2 micro-batches; for Qwen2-MoE too, whose
shared experts the daemon holds (the attention engine loads none). The daemon is an
FfnServer on a thread of the test (the subprocess one is test_afd.py's)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from splitserve.afd.ffn_server import FfnServer
from splitserve.config import AfdConfig
from splitserve.engine.llm import LLM, engine_config_from_kwargs
from splitserve.model.loader import load_decoder_config
from splitserve.model.moe import load_experts
from splitserve.model.tiny_moe import TinyMoeSpec
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from tests.engine.helpers import make_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = {"num_blocks": 64}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_dense_layer_between_sparse_ones(tiny_model_factory, monkeypatch, arch):
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    model_dir = tiny_model_factory(
        arch=arch, layers=3, dtype="bfloat16", moe=TinyMoeSpec(mlp_only_layers=(1,))
    )
    prompts = make_prompts(2048, seed=11)[:4]
    expected = [r.token_ids for r in LLM(model_dir, **ENGINE).generate(prompts, GREEDY)]
    config = load_decoder_config(model_dir)
    server = FfnServer(
        load_experts(model_dir, config, torch.bfloat16, torch.device("cpu")), config, torch.bfloat16
    )
    assert server.layout.sparse_layers == (0, 2)
    assert server.layout.shared_expert == (arch == "qwen2_moe")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        engine = engine_config_from_kwargs(model_dir, **ENGINE)
        layers_sent = {}
        for microbatches in (1, 2):
            afd = AfdConfig("127.0.0.1", server.port, timeout_s=30.0, microbatches=microbatches)
            llm = LLM(config=dataclasses.replace(engine, afd=afd))
            sparse = [llm.engine.runner.model.layers[i].mlp for i in (0, 2)]
            assert all(mlp.experts is None and mlp.shared_expert is None for mlp in sparse)  # the daemon's
            assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
            assert llm.engine.runner.ffn is not None
            layers_sent[microbatches] = llm.engine.runner.ffn.totals().layers
            llm.engine.shutdown()
        assert layers_sent[2] > layers_sent[1]  # the decode steps went as two halves
    finally:
        server.stop()
        thread.join(timeout=10)
