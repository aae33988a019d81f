"""The P/D connector on the engine's seam: a prefill and a decode AsyncEngine (threads of
this process, talking over real transports) must produce collocated greedy output."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.kv.connector.pd_connector import make_pd_connector
from splitserve.model.linear import gemv_kernel_available
from splitserve.protocol.kv_transfer import KVTransferParams
from splitserve.protocol.sampling_params import SamplingParams
from tests.generate_requests import generate_request
from tests.kv.transport_peer import TRANSPORTS

VOCAB = 2048
BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def make_engine(
    model: str,
    role: str,
    transfer: TransferConfig | None = None,
    budget: int = 2048,
    dtype: str | None = None,
):
    config = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(num_blocks=96, block_size=BLOCK),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=budget),
        role=role,
        transfer=transfer or TransferConfig(),
    )
    connector = make_pd_connector(role, config.transfer) if role != "both" else None
    return AsyncEngine(config, connector=connector).start(), connector


async def collect(outputs) -> tuple[list[int], object]:
    tokens, last = [], None
    async for output in outputs:
        tokens += output.new_token_ids
        last = output
    return tokens, last


async def pd_generate(prefill, decode, request_id: str, tokens: list[int], mode: str, params=GREEDY):
    """The proxy's flow, without HTTP: returns (tokens, decode's final output, prefill's)."""
    _, dconn = decode
    if mode == "push":
        task = asyncio.ensure_future(
            collect(
                decode[0].generate(
                    generate_request(
                        request_id, tokens, params, kv_transfer_params={"do_remote_prefill": True}
                    )
                )
            )
        )
        reservation = await asyncio.to_thread(dconn.reservations.wait, request_id, 30)
        assert reservation is not None
        prefill_out = None
        if reservation.block_ids:
            kv = {
                "do_remote_decode": True,
                "transfer_mode": "push",
                "remote_request_id": request_id,
                "remote_block_ids": reservation.block_ids,
                "remote_first_block": reservation.first_block,
                **KVTransferParams().with_address(dconn.kv_address()).to_wire(),
            }
            _, prefill_out = await collect(
                prefill[0].generate(
                    generate_request(request_id + "-p", tokens, params, kv_transfer_params=kv)
                )
            )
        out_tokens, final = await task
        return out_tokens, final, prefill_out
    _, prefill_out = await collect(
        prefill[0].generate(
            generate_request(
                request_id,
                tokens,
                params,
                kv_transfer_params={"do_remote_decode": True, "transfer_mode": "pull"},
            )
        )
    )
    out_tokens, final = await collect(
        decode[0].generate(
            generate_request(request_id, tokens, params, kv_transfer_params=prefill_out.kv_transfer_params)
        )
    )
    return out_tokens, final, prefill_out


@pytest.fixture(scope="module")
def collocated(tiny_model) -> Iterator[AsyncEngine]:
    engine, _ = make_engine(tiny_model, "both")
    yield engine
    engine.shutdown()


PROMPTS = {
    "odd": prompt(1, 37),
    "exact": prompt(2, 48),
    "one-over": prompt(3, 49),
    "short": prompt(4, 5),
    "long": prompt(5, 150),
}
SHARED = prompt(6, 40)  # 2 full blocks + 8 tokens: decode gets a partial prefix hit
FOLLOW_UPS = {"hit-a": SHARED + prompt(7, 21), "hit-b": SHARED[:32] + prompt(8, 16)}


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_disaggregated_greedy_equals_collocated(tiny_model, collocated, kind, mode):
    transfer = TransferConfig(transport=kind, mode=mode, timeout_s=10, reservation_ttl_s=30)
    prefill = make_engine(tiny_model, "prefill", transfer, budget=64)  # chunked: blocks ship as they finish
    decode = make_engine(tiny_model, "decode", transfer)

    async def run() -> None:
        expected = {}
        for name, tokens in {**PROMPTS, **FOLLOW_UPS, "shared": SHARED}.items():
            expected[name], _ = await collect(
                collocated.generate(generate_request(f"ref-{kind}-{mode}-{name}", tokens, GREEDY))
            )
        results = await asyncio.gather(
            *(pd_generate(prefill, decode, f"{name}-{kind}-{mode}", t, mode) for name, t in PROMPTS.items())
        )
        for (name, _), (tokens, final, _) in zip(PROMPTS.items(), results, strict=True):
            assert tokens == expected[name], name
            handoff = final.kv_transfer_params["handoff"]
            assert handoff["transferred"], (name, handoff)
            assert handoff["bytes"] > 0
        # decode caches SHARED's blocks; follow-ups then transfer only what decode lacks
        await pd_generate(prefill, decode, f"shared-{kind}-{mode}", SHARED, mode)
        for name, tokens in FOLLOW_UPS.items():
            out, final, _ = await pd_generate(prefill, decode, f"{name}-{kind}-{mode}", tokens, mode)
            assert out == expected[name], name
            assert final.num_cached_tokens == len(tokens) - 1
            block_bytes = final.kv_transfer_params["handoff"]["bytes"] // (-(-(len(tokens) - 1) // BLOCK) - 2)
            assert (
                block_bytes * (-(-(len(tokens) - 1) // BLOCK) - 2)
                == final.kv_transfer_params["handoff"]["bytes"]
            )

        # prefill holds a prefix decode lacks: its cached blocks must travel too
        warm = prompt(9, 50)
        await collect(prefill[0].generate(generate_request(f"warm-{kind}-{mode}", warm, GREEDY)))
        tokens = warm + prompt(10, 30)
        reference, _ = await collect(
            collocated.generate(generate_request(f"ref-warm-{kind}-{mode}", tokens, GREEDY))
        )
        out, final, _ = await pd_generate(prefill, decode, f"warm-pd-{kind}-{mode}", tokens, mode)
        assert out == reference
        assert final.kv_transfer_params["handoff"]["transferred"]

        if mode == "pull":  # decode never attends to KV computed for other tokens
            _, prefill_out = await collect(
                prefill[0].generate(
                    generate_request(
                        f"midnight-{kind}",
                        PROMPTS["odd"],
                        GREEDY,
                        kv_transfer_params={"do_remote_decode": True},
                    )
                )
            )
            changed = [*PROMPTS["odd"][:10], PROMPTS["odd"][10] + 1, *PROMPTS["odd"][11:]]
            reference, _ = await collect(
                collocated.generate(generate_request(f"ref-midnight-{kind}", changed, GREEDY))
            )
            params = prefill_out.kv_transfer_params
            out, final = await collect(
                decode[0].generate(
                    generate_request(f"midnight-{kind}", changed, GREEDY, kv_transfer_params=params)
                )
            )
            assert out == reference
            assert final.kv_transfer_params["handoff"]["transferred"] is False
            registry = decode[1].metrics.registry
            assert (
                registry.get_sample_value("splitserve_kv_fallbacks_total", {"action": "token_mismatch"}) >= 1
            )
            prefill[1].holds.release(params["remote_request_id"])  # nobody will read it

            # the same tokens under another tenant's cache_salt: the hold is not lent to it
            _, prefill_out = await collect(
                prefill[0].generate(
                    generate_request(
                        f"salted-{kind}",
                        PROMPTS["long"],
                        GREEDY,
                        cache_salt="tenant-a",
                        kv_transfer_params={"do_remote_decode": True},
                    ),
                )
            )
            params = prefill_out.kv_transfer_params
            out, final = await collect(
                decode[0].generate(
                    generate_request(
                        f"salted-{kind}",
                        PROMPTS["long"],
                        GREEDY,
                        cache_salt="tenant-b",
                        kv_transfer_params=params,
                    ),
                )
            )
            assert out == expected["long"]
            assert final.kv_transfer_params["handoff"]["transferred"] is False
            assert "no longer holds" in final.kv_transfer_params["handoff"]["error"]
            prefill[1].holds.release(params["remote_request_id"])

    try:
        asyncio.run(run())
        text = decode[1].metrics.registry
        assert (
            text.get_sample_value("splitserve_kv_transfers_total", {"side": "decode", "outcome": "ok"}) >= 8
        )
        assert text.get_sample_value("splitserve_kv_reservations_active") == 0
        assert decode[0].engine.block_manager.num_free_blocks == 96
        deadline = time.monotonic() + 5  # released holds are freed by the engine thread
        while prefill[0].engine.block_manager.num_free_blocks != 96 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill[0].engine.block_manager.num_free_blocks == 96, "pull holds were not released"
    finally:
        prefill[0].shutdown()
        decode[0].shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_reservation_that_never_receives_kv_is_released_after_the_ttl(tiny_model, collocated, policy):
    transfer = TransferConfig(transport="tcp", reservation_ttl_s=0.5, timeout_s=2, failure_policy=policy)
    decode = make_engine(tiny_model, "decode", transfer)
    decode[1].set_abort(decode[0].abort)

    async def run() -> None:
        tokens = PROMPTS["long"]
        expected, _ = await collect(
            collocated.generate(generate_request(f"ref-ttl-{policy}", tokens, GREEDY))
        )
        params = {"do_remote_prefill": True}
        task = asyncio.ensure_future(
            collect(decode[0].generate(generate_request("ttl", tokens, GREEDY, kv_transfer_params=params)))
        )
        reservation = await asyncio.to_thread(decode[1].reservations.wait, "ttl", 10)
        assert reservation is not None and len(reservation.block_ids) == -(-(len(tokens) - 1) // BLOCK)
        assert decode[0].engine.block_manager.num_free_blocks < 96  # held while waiting
        out, final = await task
        handoff = final.kv_transfer_params["handoff"]
        assert handoff["transferred"] is False and "TTL" in handoff["error"]
        if policy == "recompute":
            assert out == expected
        else:
            assert out == [] and final.finish_reason == "abort"

    try:
        asyncio.run(run())
        registry = decode[1].metrics.registry
        assert registry.get_sample_value("splitserve_kv_reservations_expired_total") == 1
        assert registry.get_sample_value("splitserve_kv_fallbacks_total", {"action": policy}) == 1
        assert registry.get_sample_value("splitserve_kv_reservations_active") == 0
        assert decode[0].engine.block_manager.num_free_blocks == 96
    finally:
        decode[0].shutdown()


@pytest.mark.skipif(not gemv_kernel_available(), reason="the compiled bf16 decode needs AVX512-BF16")
def test_a_bf16_decode_worker_runs_its_layers_compiled_and_equals_collocated(tiny_model):
    """A decode worker's connector has no per-layer work, so its steps run the compiled
    layers (model/compiled_layers.py), and the pushed KV still gives collocated tokens."""
    transfer = TransferConfig(transport="shm", mode="push", timeout_s=10, reservation_ttl_s=30)
    collocated, _ = make_engine(tiny_model, "both", dtype="bfloat16")
    prefill = make_engine(tiny_model, "prefill", transfer, budget=64, dtype="bfloat16")
    decode = make_engine(tiny_model, "decode", transfer, dtype="bfloat16")
    try:

        async def run() -> None:
            for name, tokens in PROMPTS.items():
                expected, _ = await collect(
                    collocated.generate(generate_request(f"ref-bf16-{name}", tokens, GREEDY))
                )
                out, final, _ = await pd_generate(prefill, decode, f"bf16-{name}", tokens, "push")
                assert out == expected, name
                assert final.kv_transfer_params["handoff"]["transferred"], name

        asyncio.run(run())
        plans = decode[0].engine.model.layer_plans
        assert plans[torch.bfloat16, True] is not None  # its decode steps took the compiled layers
    finally:
        for engine in (collocated, prefill[0], decode[0]):
            engine.shutdown()
