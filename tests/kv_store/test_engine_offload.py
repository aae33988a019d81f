"""An engine with `--kv-store`'s connector against a real store (in process, over
127.0.0.1): the blocks its small pool evicts come back from the store, with the same
greedy tokens as an engine without a store."""

from __future__ import annotations

import random

import pytest

from splitserve.engine.kv_store_client import KVStoreClient
from splitserve.engine.llm import LLM
from splitserve.kv_store.server import KVStoreServer
from splitserve.kv_store.tiers import TieredStore
from splitserve.kv_store.wire import BlockKey, StoreClient
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.sampling_params import SamplingParams
from tests.conftest import free_port, wait_until

TOKEN = "engine-store-token"
BLOCK = 16
NUM_BLOCKS = 12  # 192 token slots: one 90-token prompt and its output at a time, no more
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(length)]


SESSION_A = prompt(1)
OTHERS = [prompt(seed) for seed in range(2, 5)]


@pytest.fixture(scope="module")
def without_store(tiny_model):
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    return [llm.generate([p], GREEDY)[0] for p in [SESSION_A, *OTHERS, SESSION_A]]


@pytest.fixture
def store_server():
    server = KVStoreServer(TieredStore(64 << 20), port=free_port(), token=TOKEN)
    try:
        yield server
    finally:
        server.close()


def run_session(llm: LLM, connector: KVStoreClient) -> list:
    """A's prompt, enough others to evict it, then A again (one at a time)."""
    results = []
    for p in [SESSION_A, *OTHERS, SESSION_A]:
        results.append(llm.generate([p], GREEDY)[0])
        assert connector.flush(), "the offload queue did not drain"
    return results


def test_evicted_blocks_come_back_from_the_store(tiny_model, without_store, store_server):
    connector = KVStoreClient("127.0.0.1", store_server.port, TOKEN)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    try:
        results = run_session(llm, connector)
    finally:
        llm.engine.shutdown()
    assert [r.token_ids for r in results] == [r.token_ids for r in without_store]
    # without the store, A's second turn finds nothing of it left in the small pool
    assert without_store[-1].num_cached_tokens == 0
    # with it: A's 5 full blocks (80 tokens; the 6th holds the last prompt token) from the store
    assert results[-1].num_cached_tokens == 80
    assert connector.stats.loaded_blocks == 5 and connector.stats.failed_loads == 0
    assert connector.stats.offloaded_blocks >= 5 and connector.stats.dropped_full == 0
    stats = store_server.store.snapshot()
    assert stats.tiers["ram"].hits == 5
    llm.engine.check_integrity()


def test_a_store_that_is_down_costs_only_hits(tiny_model, without_store):
    connector = KVStoreClient("127.0.0.1", free_port(), TOKEN, timeout_s=0.2, load_timeout_s=0.2)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    try:
        results = run_session(llm, connector)
    finally:
        llm.engine.shutdown()
    assert [r.token_ids for r in results] == [r.token_ids for r in without_store]
    assert results[-1].num_cached_tokens == 0
    assert connector.stats.loaded_blocks == 0 and connector.stats.lookup_errors >= 1
    assert connector.stats.offloaded_blocks == 0


def test_another_tenant_salt_finds_nothing(tiny_model, store_server):
    """The store's blocks are keyed by the chained hashes, cache_salt included: another
    tenant's identical prompt is a miss; the same tenant's is a hit."""
    connector = KVStoreClient("127.0.0.1", store_server.port, TOKEN)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    try:
        llm.generate([SESSION_A], GREEDY, cache_salt="tenant-a")
        for p in OTHERS:
            llm.generate([p], GREEDY, cache_salt="tenant-a")
        assert connector.flush()
        assert llm.generate([SESSION_A], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
        assert connector.flush()
        for p in OTHERS:
            llm.generate([p], GREEDY, cache_salt="tenant-b")
        assert llm.generate([SESSION_A], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 80
    finally:
        llm.engine.shutdown()


def test_a_full_offload_queue_drops_and_counts(tiny_model, store_server):
    """The offload thread stuck in a PUT (its client held here) never stalls a step:
    one block waits in the queue, (once it woke) one in the stuck PUT, the rest are dropped and counted."""
    connector = KVStoreClient("127.0.0.1", store_server.port, TOKEN, queue_blocks=1, batch_blocks=1)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    try:
        with connector.offload_client.lock:
            results = [llm.generate([p], GREEDY)[0] for p in [SESSION_A, *OTHERS]]
            s = connector.stats
            assert s.offered_blocks >= 5 and s.dropped_full >= s.offered_blocks - 2
        assert connector.flush()
    finally:
        llm.engine.shutdown()
    assert s.offloaded_blocks in (1, 2) and s.offloaded_blocks + s.dropped_full == s.offered_blocks
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results)


def test_a_stored_block_of_another_layout_is_refused(tiny_model, without_store, store_server):
    """Blocks under A's hashes, parents and tokens but of another shape (another model's,
    or a hostile writer's) never land in the pool: the load is refused, A recomputes and
    answers as without the store."""
    connector = KVStoreClient("127.0.0.1", store_server.port, TOKEN)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    writer = StoreClient("127.0.0.1", store_server.port, TOKEN, timeout_s=5)
    try:
        hashes = compute_block_hashes(SESSION_A, BLOCK)
        keys = [
            BlockKey(h, hashes[i - 1] if i else None, tuple(SESSION_A[i * BLOCK : (i + 1) * BLOCK]))
            for i, h in enumerate(hashes)
        ]
        meta = {**connector.meta, "shape": [1, 2, BLOCK, 1, 8]}
        assert writer.put([(key, meta, bytes(2 * BLOCK * 8 * 4)) for key in keys]) == len(keys)
        result = llm.generate([SESSION_A], GREEDY)[0]
    finally:
        writer.close()
        llm.engine.shutdown()
    assert result.token_ids == without_store[0].token_ids and result.num_cached_tokens == 0
    assert connector.stats.failed_loads == 1 and connector.stats.loaded_blocks == 0


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends(tiny_model, store_server):
    connector = KVStoreClient("127.0.0.1", store_server.port, TOKEN)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    engine = llm.engine
    try:
        for p in [SESSION_A, *OTHERS]:  # A's blocks go to the store
            llm.generate([p], GREEDY)
        assert connector.flush()
        with connector.load_client.lock:  # the load cannot finish yet
            engine.add_request(GenerateRequest("again", tuple(SESSION_A), GREEDY))
            engine.step()  # admitted: its blocks allocated, its load queued
            held = engine.block_manager.num_free_blocks
            assert held < NUM_BLOCKS and engine.abort_request("again") == ["again"]
            engine.step()
            assert engine.block_manager.num_free_blocks == held  # a load may still write into them
        assert wait_until(
            lambda: engine.step() is not None and engine.block_manager.num_free_blocks == NUM_BLOCKS
        )
        engine.check_integrity()
        assert llm.generate([SESSION_A], GREEDY)[0].num_cached_tokens == 80  # the store still serves
    finally:
        engine.shutdown()


def test_a_store_restarted_mid_run_costs_only_its_hits(tiny_model, without_store):
    port = free_port()
    server = KVStoreServer(TieredStore(64 << 20), port=port, token=TOKEN)
    connector = KVStoreClient("127.0.0.1", port, TOKEN)
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    try:
        for p in [SESSION_A, *OTHERS]:  # A is evicted here, into the store
            llm.generate([p], GREEDY)
        assert connector.flush()
        server.close()  # and all it held is gone
        server = KVStoreServer(TieredStore(64 << 20), port=port, token=TOKEN)
        after = run_session(llm, connector)  # A misses once, then is offloaded and hits again
    finally:
        llm.engine.shutdown()
        server.close()
    assert [r.token_ids for r in after] == [r.token_ids for r in without_store]
    assert after[0].num_cached_tokens == 0 and after[-1].num_cached_tokens == 80
    assert connector.stats.failed_loads == 0


def test_an_engine_with_another_token_gets_no_hits(tiny_model, without_store, store_server):
    connector = KVStoreClient("127.0.0.1", store_server.port, "another-deployment")
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_store=connector)
    try:
        results = run_session(llm, connector)
    finally:
        llm.engine.shutdown()
    assert [r.token_ids for r in results] == [r.token_ids for r in without_store]
    assert results[-1].num_cached_tokens == 0 and connector.stats.lookup_errors >= 1
    assert store_server.store.snapshot().puts == 0 and store_server.refused >= 1
