"""Qwen3-MoE: greedy token IDs equal transformers' `generate` (float32) through the
engine API (batched prompts of mixed lengths, chunked prefill, prefix-cache hits) and
through `serve`; Qwen2-MoE (a gated shared expert beside the routed ones) through the
engine API."""

from __future__ import annotations

import httpx
import pytest

from splitserve.engine.llm import LLM
from splitserve.model.tiny_moe import TinyMoeSpec
from splitserve.protocol.sampling_params import SamplingParams
from tests.conftest import free_port, running_server
from tests.engine.helpers import make_prompts, oracle_greedy

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# 8 experts, top-2 renormalized, every layer sparse
DEFAULT = TinyMoeSpec()
# 6 experts, top-3 not renormalized, every 2nd layer sparse except layer 3
VARIANT = TinyMoeSpec(
    experts=6, experts_per_token=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=(3,)
)


@pytest.fixture(scope="module")
def moe_case(tiny_model_factory):
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, moe=DEFAULT)
    prompts = make_prompts(2048, seed=1)
    return model_dir, prompts, oracle_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16], ids=["whole-prompts", "chunked"])
def test_greedy_equals_transformers(moe_case, max_num_batched_tokens):
    model_dir, prompts, expected = moe_case
    llm = LLM(model_dir, num_blocks=64, max_num_batched_tokens=max_num_batched_tokens)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    # again: every prompt's full blocks (never its last token) are prefix-cache hits
    again = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in again] == expected
    assert [r.num_cached_tokens for r in again] == [((len(p) - 1) // 16) * 16 for p in prompts]
    llm.engine.check_integrity()


def test_sparse_step_mlp_only_layers_and_unnormalized_top_k(tiny_model_factory):
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, moe=VARIANT)
    prompts = make_prompts(2048, seed=3)[:5]
    expected = oracle_greedy(model_dir, prompts, 8)
    llm = LLM(model_dir, num_blocks=64, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected


def test_qwen2_moe_with_its_shared_experts_equals_transformers(tiny_model_factory):
    """Qwen2-MoE: every sparse layer adds a sigmoid-gated shared expert (128 wide) to its
    routed experts (top-2 of 8, not renormalized); a dense layer of another width (192)
    between two sparse ones; q/k/v biases. Batched, chunked prefill."""
    spec = TinyMoeSpec(norm_topk_prob=False, mlp_only_layers=(1,))
    model_dir = tiny_model_factory(arch="qwen2_moe", layers=3, moe=spec)
    prompts = make_prompts(2048, seed=4)[:5]
    expected = oracle_greedy(model_dir, prompts, 8)
    llm = LLM(model_dir, num_blocks=64, max_num_batched_tokens=24)
    sparse = [layer.mlp for layer in llm.engine.runner.model.layers if hasattr(layer.mlp, "shared_expert")]
    assert len(sparse) == 2 and all(mlp.shared_expert is not None for mlp in sparse)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected


def test_serve_answers_the_oracle_tokens(moe_case):
    model_dir, prompts, expected = moe_case
    port = free_port()
    args = ["serve", model_dir, "--port", str(port), "--num-blocks", "64", "--max-num-batched-tokens", "32"]
    with running_server(args, port) as base:
        for prompt, tokens in zip(prompts[:4], expected[:4], strict=True):
            body = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            response = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == tokens
