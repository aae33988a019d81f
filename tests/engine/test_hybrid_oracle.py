"""The tiny Nemotron-H (Mamba2 + attention + MLP layers, and one with MoE layers too):
greedy tokens equal transformers' `generate` through the engine API in every scheduling
mode, and through `serve`'s OpenAI API; the Mamba state slots are taken and given back
with the requests."""

from __future__ import annotations

import httpx
import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.state_pool import MambaStatePool
from splitserve.model.nemotron_h_config import load_nemotron_h_config
from splitserve.protocol.sampling_params import SamplingParams
from tests.conftest import free_port, running_server
from tests.engine.helpers import make_prompts, oracle_greedy
from tests.generate_requests import generate_request

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

MODES = {
    # name: engine kwargs (16-token blocks; the tiny model's Mamba scan chunks are 8 tokens)
    "whole-prompts": {"num_blocks": 64, "max_num_batched_tokens": 2048},
    "chunked-16": {"num_blocks": 64, "max_num_batched_tokens": 16},
    "chunked-7": {"num_blocks": 64, "max_num_batched_tokens": 7},
    "chunked-33": {"num_blocks": 64, "max_num_batched_tokens": 33},
    "preemption": {"num_blocks": 8, "max_num_batched_tokens": 64},
}


# the tiny model's default layers, and one with two MoE layers (E: a sigmoid router over
# grouped experts, non-gated experts and a shared one) among Mamba, attention and MLP layers
PATTERNS = {"dense": "M-M*-M-", "moe": "M-ME*E"}


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def hybrid_case(request, tiny_model_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    pattern = PATTERNS[request.param]
    model_dir = tiny_model_factory(arch="nemotron_h", pattern=pattern)
    moe = load_nemotron_h_config(model_dir).moe
    assert (moe is not None) == ("E" in pattern)
    prompts = make_prompts(2048, seed=1)
    return model_dir, prompts, oracle_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_transformers(hybrid_case, mode):
    model_dir, prompts, expected = hybrid_case
    llm = LLM(model_dir, **MODES[mode])
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    stats = llm.engine.stats()
    assert (stats.num_preemptions > 0) == (mode == "preemption")
    llm.engine.check_integrity()
    pool = llm.engine.runner.state_pool
    assert pool is not None and pool.num_free_slots == pool.num_slots  # every slot given back
    assert stats.num_blocks_free == stats.num_blocks_total
    # Second round: every prompt's full blocks are cached with a state snapshot at each
    # boundary; the hit resumes from the one before the last prompt token
    again = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in again] == expected
    if mode != "preemption":
        assert [r.num_cached_tokens for r in again] == [((len(p) - 1) // 16) * 16 for p in prompts]
    llm.engine.check_integrity()


def test_mixed_steps_abort_and_slot_limit(hybrid_case):
    """Prompts arrive while others decode (steps mix prefill chunks and decode rows), only
    two requests hold state slots at a time (the state budget's, not --max-num-seqs'),
    one request is aborted mid-decode: the others' tokens are the oracle's and the slot
    accounting holds after every step."""
    model_dir, prompts, expected = hybrid_case
    hybrid = load_nemotron_h_config(model_dir)
    slot_bytes = MambaStatePool.bytes_per_slot(hybrid.num_mamba_layers, hybrid.mamba, torch.float32)
    engine = LLMEngine(
        EngineConfig(
            ModelConfig(model_dir),
            CacheConfig(num_blocks=64, state_cache_bytes=2 * slot_bytes + 1),
            SchedulerConfig(max_num_batched_tokens=24),
        )
    )
    pool = engine.runner.state_pool
    assert pool is not None and pool.num_slots == 2 and pool.slot_bytes == slot_bytes
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    mixed_steps, held_back, aborted = 0, 0, False
    while pending or engine.has_unfinished_requests():
        if pending:
            i = pending.pop(0)
            engine.add_request(generate_request(f"r{i}", prompts[i], GREEDY))
        if not aborted and len(tokens["r2"]) == 3:
            aborted = engine.abort_request("r2") == ["r2"]
        running = engine.scheduler.running
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        mixed_steps += int(0 < decoding < len(running))
        assert len(pool.slots) <= 2 and len(engine.scheduler.running) <= 2
        held_back += int(len(engine.scheduler.running) == 2 and bool(engine.scheduler.waiting))
        engine.check_integrity()
    assert mixed_steps > 0 and held_back > 0 and aborted  # held back: waiting for a slot
    assert pool.num_free_slots == 2
    assert tokens["r2"] == expected[2][:3]
    assert [tokens[f"r{i}"] for i in range(len(prompts)) if i != 2] == [
        e for i, e in enumerate(expected) if i != 2
    ]


def test_serve_openai_completions_equal_transformers(hybrid_case):
    model_dir, prompts, expected = hybrid_case
    port = free_port()
    args = ["serve", model_dir, "--port", str(port), "--num-blocks", "64", "--max-num-batched-tokens", "16"]
    args += ["--state-snapshot-memory", "1MiB"]
    with running_server(args, port) as base:
        body = {
            "prompt": prompts[:4],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        response = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == expected[:4]
        # the 70-token prompt again: a prefix hit from the snapshot at 64, same tokens
        again = httpx.post(base + "/v1/completions", json={**body, "prompt": prompts[2]}, timeout=60).json()
        assert again["choices"][0]["token_ids"] == expected[2]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        # a bad request to a hybrid model is still a clean 4xx
        bad = httpx.post(base + "/v1/completions", json={"prompt": [10**9], "max_tokens": 2}, timeout=30)
        assert bad.status_code == 400


def test_a_connector_that_cannot_move_the_state_refuses_a_hybrid_model(hybrid_case):
    """It would hand over the attention KV without the Mamba state: refused at start."""
    from splitserve.kv.connector.inprocess import InProcessConnector, InProcessKVStore

    model_dir, _, _ = hybrid_case
    connector = InProcessConnector(InProcessKVStore(), "prefill-0")
    with pytest.raises(ValueError, match="cannot hand over a hybrid model's Mamba state"):
        LLM(model_dir, num_blocks=8, role="prefill", connector=connector)


def test_prefix_hits_resume_from_the_latest_snapshot(hybrid_case):
    """A second turn hits up to the last block boundary of the first turn's prompt (the
    boundaries its answer crossed were computed as generated tokens, a different state for
    transformers); with room for fewer snapshots the hit only shortens, tokens stay right."""
    model_dir, prompts, _ = hybrid_case
    turn1 = prompts[2][:40]
    llm = LLM(model_dir, num_blocks=64)
    answer1 = llm.generate([turn1], GREEDY)[0]
    turn2 = turn1 + answer1.token_ids + [7, 8, 9, 10, 11]
    answer2 = llm.generate([turn2], GREEDY)[0]
    assert [answer1.token_ids, answer2.token_ids] == oracle_greedy(model_dir, [turn1, turn2], MAX_TOKENS)
    assert answer2.num_cached_tokens == 32  # KV blocks of 48 tokens are cached, snapshots to 32
    llm.engine.check_integrity()

    slot_bytes = llm.engine.runner.state_pool.slot_bytes
    for snapshots, hit in ((2, 32), (1, 0)):  # the answer's boundary (48) evicts the oldest
        small = LLM(model_dir, num_blocks=64, state_snapshot_bytes=snapshots * slot_bytes)
        small.generate([turn1], GREEDY)
        again = small.generate([turn1], GREEDY)[0]
        assert again.token_ids == answer1.token_ids and again.num_cached_tokens == hit
        small.engine.check_integrity()


def test_up_refuses_a_hybrid_model_in_pull_mode(hybrid_case, capsys):
    """The state travels in a push only: refused before any part starts."""
    from splitserve.cli import main

    model_dir, _, _ = hybrid_case
    assert main(["up", model_dir, "--port", str(free_port()), "--mode", "pull"]) == 2
    assert "drop --mode pull" in capsys.readouterr().err
