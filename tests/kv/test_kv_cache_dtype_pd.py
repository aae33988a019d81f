"""P/D between engines whose KV caches differ in dtype (`--kv-cache-dtype`): a float32
cache's bytes read as float16 would be garbage that looks like KV, so the KV connection
is refused at its set-up, naming both dtypes; the request then follows the failure policy."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.kv.connector.pd_connector import make_pd_connector
from tests.generate_requests import generate_request
from tests.kv.test_pd_connector import BLOCK, GREEDY, PROMPTS, collect, pd_generate


def make_engine(model: str, role: str, kv_cache_dtype: str, policy: str = "fail"):
    config = EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(num_blocks=96, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_model_len=1024),
        role=role,
        # decode learns of a failed push when its reservation expires
        transfer=TransferConfig(transport="tcp", timeout_s=5, failure_policy=policy, reservation_ttl_s=1.0),
    )
    connector = make_pd_connector(role, config.transfer) if role != "both" else None
    return AsyncEngine(config, connector=connector).start(), connector


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_float32_prefill_and_a_float16_decode_are_refused_naming_the_dtypes(tiny_model, policy):
    prefill = make_engine(tiny_model, "prefill", "float32")
    decode = make_engine(tiny_model, "decode", "float16", policy)
    decode[1].set_abort(decode[0].abort)
    collocated = make_engine(tiny_model, "both", "float16")[0]
    tokens = PROMPTS["long"]

    async def run() -> None:
        expected, _ = await collect(collocated.generate(generate_request(f"ref-{policy}", tokens, GREEDY)))
        out, final, prefill_out = await pd_generate(prefill, decode, f"mix-{policy}", tokens, "push")
        error = prefill_out.kv_transfer_params["kv_transfer_error"]  # the prefill's report: why
        assert "KV cache dtypes differ, ours float32, peer" in error and "float16" in error, error
        assert "--kv-cache-dtype" in error
        assert final.kv_transfer_params["handoff"]["transferred"] is False  # decode wrote nothing from it
        if policy == "recompute":  # decode computed the prompt itself, in its own cache
            assert out == expected
        else:
            assert out == [] and final.finish_reason == "abort"

    try:
        asyncio.run(run())
    finally:
        for engine in (prefill[0], decode[0], collocated):
            engine.shutdown()
