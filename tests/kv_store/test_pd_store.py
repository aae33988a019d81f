"""`--kv-store` on P/D engines (prefill and decode AsyncEngines of this process, a real
transport between them, a real store over 127.0.0.1): a prompt evicted from both pools
comes back from the store as local prefix hits, so a prefill pushes the store's blocks to
decode like any hit, and a decode with the store needs only the last block pushed.
Greedy tokens equal a collocated engine's throughout."""

from __future__ import annotations

import asyncio
import random

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.kv_store_client import KVStoreClient
from splitserve.kv.connector.pd_connector import make_pd_connector
from splitserve.kv_store.server import KVStoreServer
from splitserve.kv_store.tiers import TieredStore
from splitserve.protocol.sampling_params import SamplingParams
from tests.conftest import free_port
from tests.generate_requests import generate_request
from tests.kv.test_pd_connector import collect, pd_generate

TOKEN = "pd-store-token"
BLOCK = 16
NUM_BLOCKS = 12  # one 90-token prompt and its output at a time: the next one evicts it
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


SESSION_A = prompt(1)
OTHERS = [prompt(seed) for seed in range(2, 5)]


Engine = tuple[AsyncEngine, object, KVStoreClient | None]  # the engine, its P/D connector, its store client


def make_engine(model: str, role: str, store_port: int | None) -> Engine:
    transfer = TransferConfig(transport="tcp", mode="push", timeout_s=10, reservation_ttl_s=30)
    config = EngineConfig(
        model=ModelConfig(model=model),
        cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
        scheduler=SchedulerConfig(max_model_len=512),
        role=role,
        transfer=transfer,
    )
    connector = make_pd_connector(role, transfer) if role != "both" else None
    store = KVStoreClient("127.0.0.1", store_port, TOKEN) if store_port else None
    engine = AsyncEngine(config, connector=connector, kv_store=store).start()
    return engine, connector, store


def test_p_d_engines_load_evicted_prompts_from_the_store(tiny_model):
    server = KVStoreServer(TieredStore(64 << 20), port=free_port(), token=TOKEN)
    engines = {
        "both": make_engine(tiny_model, "both", None),
        "prefill": make_engine(tiny_model, "prefill", server.port),
        "plain decode": make_engine(tiny_model, "decode", None),
        "store decode": make_engine(tiny_model, "decode", server.port),
    }
    prefill, plain, with_store = engines["prefill"], engines["plain decode"], engines["store decode"]

    async def run() -> None:
        expected = {}
        for i, tokens in enumerate([SESSION_A, *OTHERS]):
            reference = engines["both"][0].generate(generate_request(f"ref-{i}", tokens, GREEDY))
            expected[i], _ = await collect(reference)
        for decode, name in ((plain, "plain"), (with_store, "store")):
            for i, tokens in enumerate([SESSION_A, *OTHERS]):  # A's blocks are evicted into the store
                out, _, _ = await pd_generate(prefill[:2], decode[:2], f"{name}-{i}", tokens, "push")
                assert out == expected[i]
            for _, _, store in (prefill, decode):
                if store is not None:
                    assert await asyncio.to_thread(store.flush)
        # A again, decode without the store: prefill loads A's 5 full blocks from the store
        # into its prefix cache and pushes them with the block it computes
        out, final, prefill_out = await pd_generate(prefill[:2], plain[:2], "plain-again", SESSION_A, "push")
        assert out == expected[0]
        assert final.kv_transfer_params["handoff"]["transferred"]
        assert prefill_out.kv_transfer_params["prompt_sources"]["reused_tokens"] == 80
        # decode held nothing of A: all of it came pushed
        assert final.metrics["prefix_hit_tokens"] == 0 and final.metrics["received_tokens"] == 89
        # A again, decode with the store: decode loads the 5 blocks itself (a local hit for
        # its reservation), prefill pushes only the last block
        out, final, _ = await pd_generate(prefill[:2], with_store[:2], "store-again", SESSION_A, "push")
        assert out == expected[0]
        assert final.metrics["prefix_hit_tokens"] == 80 and final.metrics["received_tokens"] == 9

    try:
        asyncio.run(run())
        assert prefill[2].stats.failed_loads == 0 and with_store[2].stats.failed_loads == 0
        assert prefill[2].stats.loaded_blocks >= 5 and with_store[2].stats.loaded_blocks >= 5
        assert server.store.snapshot().tiers["ram"].hits >= 10
        for engine, _, _ in engines.values():
            engine.engine.check_integrity()
    finally:
        for engine, _, _ in engines.values():
            engine.shutdown()
        server.close()
