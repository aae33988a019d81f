"""Prefill-only and decode-only engines in one process, KV handed over by the in-process
connector, give exactly the collocated token IDs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from splitserve.config import CacheConfig, EngineConfig, ModelConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.llm import LLM
from splitserve.kv.connector.inprocess import InProcessConnector, InProcessKVStore
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts
from tests.generate_requests import generate_request

PROMPTS = make_prompts(2048, seed=5)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def collocated(tiny_model):
    return [r.token_ids for r in LLM(tiny_model, num_blocks=64).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("load_async", [False, True])
def test_prefill_then_decode_equals_collocated(tiny_model, collocated, load_async):
    store = InProcessKVStore()
    prefill_connector = InProcessConnector(store, "prefill-0")
    # a small budget chunks the prefill: KV is saved layer by layer over several steps
    prefill = LLM(
        tiny_model, num_blocks=64, role="prefill", max_num_batched_tokens=24, connector=prefill_connector
    )
    decode = LLM(
        tiny_model, num_blocks=64, role="decode", connector=InProcessConnector(store, "d", load_async)
    )

    first = prefill.generate(PROMPTS, GREEDY, kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
    assert all(len(r.token_ids) == 1 and r.finish_reason == "length" for r in first)
    assert [r.token_ids[0] for r in first] == [tokens[0] for tokens in collocated]
    assert prefill_connector.num_saved_layers > 0
    params = [r.kv_transfer_params for r in first]
    assert all(
        p["do_remote_prefill"] and p["remote_num_tokens"] == len(q)
        for p, q in zip(params, PROMPTS, strict=True)
    )
    assert len(store) == len(PROMPTS)

    second = decode.generate(PROMPTS, GREEDY, kv_transfer_params=params)
    assert [r.token_ids for r in second] == collocated
    # everything but the last prompt token came over the connector (or the local cache)
    assert [r.num_cached_tokens for r in second] == [len(p) - 1 for p in PROMPTS]
    assert len(store) == 0
    decode.engine.check_integrity()
    prefill.engine.check_integrity()


def test_corrupted_transfer_changes_the_answer(tiny_model, collocated):
    """Negative control: the decode engine really uses the transferred KV."""
    store = InProcessKVStore()
    prefill = LLM(tiny_model, num_blocks=64, role="prefill", connector=InProcessConnector(store, "p"))
    decode = LLM(tiny_model, num_blocks=64, role="decode", connector=InProcessConnector(store, "d"))
    first = prefill.generate([PROMPTS[2]], GREEDY, kv_transfer_params=[{"do_remote_decode": True}])
    entry = store.get(first[0].kv_transfer_params["remote_request_id"])
    entry.kv.mul_(-3.0)
    second = decode.generate([PROMPTS[2]], GREEDY, kv_transfer_params=[first[0].kv_transfer_params])
    assert second[0].token_ids != collocated[2]


def test_async_decode_engine_wakes_on_load(tiny_model, collocated):
    store = InProcessKVStore()
    prefill = LLM(tiny_model, num_blocks=64, role="prefill", connector=InProcessConnector(store, "p"))
    first = prefill.generate(PROMPTS, GREEDY, kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
    config = EngineConfig(ModelConfig(tiny_model), CacheConfig(num_blocks=64), role="decode")

    async def run(engine: AsyncEngine, i: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(
            generate_request(f"d{i}", PROMPTS[i], GREEDY, kv_transfer_params=first[i].kv_transfer_params)
        ):
            tokens.extend(out.new_token_ids)
        return tokens

    with AsyncEngine(config, InProcessConnector(store, "d", load_async=True)) as engine:

        async def main():
            return await asyncio.gather(*(run(engine, i) for i in range(len(PROMPTS))))

        assert asyncio.run(main()) == collocated


def test_abort_while_loading_keeps_blocks_until_the_load_ends(tiny_model):
    store = InProcessKVStore()
    prefill = LLM(tiny_model, num_blocks=64, role="prefill", connector=InProcessConnector(store, "p"))
    first = prefill.generate(PROMPTS, GREEDY, kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
    config = EngineConfig(ModelConfig(tiny_model), CacheConfig(num_blocks=64), role="decode")
    with AsyncEngine(config, InProcessConnector(store, "d", load_async=True)) as engine:

        async def main():
            streams = [
                engine.generate(
                    generate_request(
                        f"d{i}", PROMPTS[i], GREEDY, kv_transfer_params=first[i].kv_transfer_params
                    )
                )
                for i in range(len(PROMPTS))
            ]
            tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
            await asyncio.sleep(0)
            for i in range(len(PROMPTS)):
                engine.abort(f"d{i}")
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
            for _ in range(200):
                stats = engine.stats()
                if stats.num_blocks_free == stats.num_blocks_total and not stats.num_waiting:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"blocks not released: {engine.stats()}")

        asyncio.run(main())
    assert len(store) == 0


def test_failed_async_load_is_recomputed(tiny_model, collocated):
    """A load that fails (here: the prefill's KV is gone from the store) costs a
    recompute, never a wrong or lost answer."""
    store = InProcessKVStore()
    prefill = LLM(tiny_model, num_blocks=64, role="prefill", connector=InProcessConnector(store, "p"))
    first = prefill.generate(PROMPTS, GREEDY, kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))

    class VanishingStore(InProcessKVStore):
        """Answers the scheduler's lookups; the loader thread finds nothing."""

        def get(self, key):
            return store.get(key) if threading.current_thread() is threading.main_thread() else None

    decode = LLM(
        tiny_model, num_blocks=64, role="decode", connector=InProcessConnector(VanishingStore(), "d", True)
    )
    second = decode.generate(PROMPTS, GREEDY, kv_transfer_params=[r.kv_transfer_params for r in first])
    assert [r.token_ids for r in second] == collocated
    # nothing came over: only local prefix-cache hits count as cached
    assert second[0].num_cached_tokens == 0
    # a request whose load fails after a neighbour cached the same prefix reuses it
    fresh = LLM(
        tiny_model, num_blocks=64, role="decode", connector=InProcessConnector(VanishingStore(), "d2", True)
    )
    params = prefill.generate([PROMPTS[2]], GREEDY, kv_transfer_params=[{"do_remote_decode": True}])[0]
    again = fresh.generate([PROMPTS[2]] * 2, GREEDY, kv_transfer_params=[None, params.kv_transfer_params])
    assert [r.token_ids for r in again] == [collocated[2], collocated[2]]
    assert again[1].num_cached_tokens == 0  # admitted before its neighbour's blocks were cached
    fresh.engine.check_integrity()
    decode.engine.check_integrity()
    assert decode.engine.stats().num_blocks_free == decode.engine.stats().num_blocks_total
