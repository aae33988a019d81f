"""KV events of a hybrid model: the router's index holds a block only while the engine
could resume a new request after it (its KV cached and the Mamba state snapshot at its
end held), so it never shows residency that is not there."""

from __future__ import annotations

from splitserve.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.state_snapshots import all_prompt_key
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.router.kv_index import KVBlockIndex, KVEventFeed
from tests.conftest import free_port, wait_until
from tests.generate_requests import generate_request

BLOCK = 16


def run_prompt(engine: LLMEngine, request_id: str, prompt: list[int]) -> int:
    """Runs the prompt to its end; the tokens its prefix hit covered."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(generate_request(request_id, prompt, params))
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    engine.check_integrity()
    return cached


def test_index_holds_only_blocks_with_a_snapshot(tiny_model_factory):
    model_dir = tiny_model_factory(arch="nemotron_h")
    events = KVEventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    probe = LLMEngine(EngineConfig(ModelConfig(model_dir), CacheConfig(num_blocks=8)))
    slot_bytes = probe.runner.state_pool.slot_bytes
    probe.shutdown()
    # room for three snapshots: the second prompt's two evict the first prompt's first
    cache = CacheConfig(block_size=BLOCK, num_blocks=64, state_snapshot_bytes=3 * slot_bytes)
    engine = LLMEngine(EngineConfig(ModelConfig(model_dir), cache, kv_events=events))
    index = KVBlockIndex()
    feed = KVEventFeed(index)
    first, second = list(range(100, 140)), list(range(300, 340))  # 40 tokens: boundaries 16, 32
    first_hashes = compute_block_hashes(first, BLOCK)
    try:
        feed.watch("w", events.endpoint, events.replay_endpoint)
        assert run_prompt(engine, "a", first) == 0
        bm, snapshots = engine.block_manager, engine.runner.state_pool.snapshots
        assert wait_until(lambda: index.held("w") == set(first_hashes[:2]))
        assert run_prompt(engine, "b", second) == 0
        # the first prompt's block 0 lost its snapshot: withdrawn, though its KV is cached
        assert first_hashes[0] in bm.cached and all_prompt_key(first_hashes[0], BLOCK) not in snapshots
        assert wait_until(lambda: index.held("w") == bm.announced)
        assert first_hashes[0] not in index.held("w") and first_hashes[1] in index.held("w")
        for i, block_hash in enumerate(compute_block_hashes(second, BLOCK)[:2]):
            assert block_hash in bm.cached and all_prompt_key(block_hash, (i + 1) * BLOCK) in snapshots
        # the index never promises more than the engine resumes (here less: 0 < 32)
        assert index.matched_blocks("w", first_hashes) == 0
        assert run_prompt(engine, "a2", first) == 32
    finally:
        feed.close()
        engine.shutdown()
