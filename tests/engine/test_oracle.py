"""Greedy token IDs equal transformers' `generate` in every scheduling mode."""

from __future__ import annotations

import pytest

from splitserve.engine.llm import LLM
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts, oracle_greedy
from tests.generate_requests import generate_request

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

MODES = {
    # name: engine kwargs
    "whole-prompts": {"num_blocks": 64, "max_num_batched_tokens": 2048},
    "chunked": {"num_blocks": 64, "max_num_batched_tokens": 16},
    "no-prefix-cache": {"num_blocks": 64, "enable_prefix_caching": False, "max_num_batched_tokens": 40},
    "preemption": {"num_blocks": 10, "max_num_batched_tokens": 64},
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_case(request, tiny_model_factory):
    model_dir = tiny_model_factory(arch=request.param)
    prompts = make_prompts(2048, seed=1)
    return model_dir, prompts, oracle_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_transformers(arch_case, mode):
    model_dir, prompts, expected = arch_case
    llm = LLM(model_dir, **MODES[mode])
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    stats = llm.engine.stats()
    if mode == "preemption":
        assert stats.num_preemptions > 0
    if mode == "no-prefix-cache":
        assert stats.prefix_cache_hit_tokens == 0
    llm.engine.check_integrity()
    assert stats.num_blocks_free == stats.num_blocks_total  # everything released

    # Second round: every prompt is now (mostly) in the prefix cache.
    again = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in again] == expected
    if MODES[mode].get("enable_prefix_caching", True) and mode != "preemption":
        hits = [r.num_cached_tokens for r in again]
        # full blocks only, and never the last prompt token
        assert hits == [((len(p) - 1) // 16) * 16 for p in prompts]


def test_prefix_hits_within_one_batch(tiny_model):
    """Requests arriving after a shared prefix was computed reuse it in the same run."""
    prompts = make_prompts(2048, seed=2)
    expected = oracle_greedy(tiny_model, prompts, 8)
    llm = LLM(tiny_model, num_blocks=64, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert llm.engine.stats().prefix_cache_hit_tokens > 0
    # the repeated 48-token prompt hits the 2 full blocks that do not hold its last token
    assert results[6].num_cached_tokens == 32


def test_max_num_seqs_caps_the_running_batch(tiny_model):
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.llm_engine import LLMEngine

    prompts = make_prompts(2048, seed=10)
    expected = oracle_greedy(tiny_model, prompts, 6)
    engine = LLMEngine(
        EngineConfig(
            ModelConfig(tiny_model),
            CacheConfig(num_blocks=64),
            SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=40),
        )
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(generate_request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        stats = engine.stats()
        assert stats.num_running <= 3 and stats.last_step_tokens <= 40
        engine.check_integrity()
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected


def test_long_prefill_threshold_chunks_prompts_only_beside_decodes(tiny_model):
    """A prompt that arrives while another request decodes computes at most
    `long_prefill_token_threshold` tokens a step (the stream stalls one chunk at a time);
    alone, it takes the whole budget. Greedy tokens are the oracle's either way."""
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.llm_engine import LLMEngine

    short, long = [5, 6, 7, 8], list(range(10, 210))
    expected = oracle_greedy(tiny_model, [short, long], 12)
    engine = LLMEngine(
        EngineConfig(
            ModelConfig(tiny_model),
            CacheConfig(num_blocks=64),
            SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=48),
        )
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {"alone": [], "short": [], "long": []}
    engine.add_request(generate_request("alone", long, params))
    for out in engine.step():
        tokens[out.request_id] += out.new_token_ids
    assert engine.stats().last_step_tokens == len(long)  # no decode beside it: one step

    engine.add_request(generate_request("short", short, params))
    steps: list[int] = []
    while engine.has_unfinished_requests():
        if len(steps) == 2:
            engine.add_request(generate_request("long", long, params))  # arrives while "short" decodes
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps.append(engine.stats().last_step_tokens)
        engine.check_integrity()
    # beside the two decodes, the long prompt goes in chunks of at most 48 tokens
    assert max(steps[2:]) <= 48 + 2
    assert sum(1 for n in steps[2:] if n > 2) >= -(-len(long) // 48)
    assert [tokens["short"], tokens["long"], tokens["alone"]] == [*expected, expected[1]]


def test_the_load_report_counts_a_waiting_prompt_past_its_cached_prefix(tiny_model):
    """A waiting request counts only the tokens past its prefix-cache hit, as the router
    counts what it sends: a finished request the router subtracts leaves no phantom load."""
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig
    from splitserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(ModelConfig(tiny_model), CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 110))
    engine.add_request(generate_request("first", prompt, params))
    assert engine.stats().num_waiting_prefill_tokens == len(prompt)  # nothing cached yet
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_waiting_prefill_tokens == 0
    engine.add_request(generate_request("again", [*prompt[:96], 7, 8, 9], params))
    assert engine.stats().num_waiting_prefill_tokens == 99 - 96  # six 16-token blocks hit
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
