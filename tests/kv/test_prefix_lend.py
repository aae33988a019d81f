"""Bidirectional P/D on the engine's seam: a prefill worker pulls the prefix a decode worker
already holds (the earlier turn's answer included), by chained block hash, and computes
only the rest. Real engines (threads of this process) over real shm and tcp transports;
the proxy's own flow is tested through `splitserve up` in tests/router/test_bidirectional_pd.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from splitserve.config import TransferConfig
from splitserve.kv.connector.prefix_lend import matched_prefix_blocks
from splitserve.protocol.kv_transfer import KVTransferParams
from splitserve.protocol.sampling_params import SamplingParams
from tests.generate_requests import generate_request
from tests.kv.test_pd_connector import collect, make_engine
from tests.kv.transport_peer import TRANSPORTS

BLOCK = 16
VOCAB = 2048


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def bidirectional(prefill, decode, request_id: str, prompt: list[int], params, salt=None):
    """The proxy's push flow with decode's prefix offer: (tokens, decode final, prefill final)."""
    dconn = decode[1]
    task = asyncio.ensure_future(
        collect(
            decode[0].generate(
                generate_request(
                    request_id,
                    prompt,
                    params,
                    cache_salt=salt,
                    kv_transfer_params={"do_remote_prefill": True},
                )
            )
        )
    )
    reservation = await asyncio.to_thread(dconn.reservations.wait, request_id, 30)
    assert reservation is not None
    prefill_out = None
    if reservation.block_ids:
        kv = KVTransferParams(
            do_remote_decode=True,
            transfer_mode="push",
            remote_request_id=request_id,
            remote_block_ids=tuple(reservation.block_ids),
            remote_first_block=reservation.first_block,
            prefix_lend_id=reservation.lend_id,
            prefix_block_ids=reservation.lent_block_ids or None,
            prefix_block_hashes=reservation.lent_block_hashes or None,
        ).with_address(dconn.kv_address())
        _, prefill_out = await collect(
            prefill[0].generate(
                generate_request(
                    request_id + "-p", prompt, params, cache_salt=salt, kv_transfer_params=kv.to_wire()
                )
            )
        )
    out, final = await task
    return out, final, prefill_out


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_prefill_pulls_the_answer_decode_generated_and_computes_only_the_new_turn(tiny_model, kind):
    transfer = TransferConfig(transport=kind, mode="push", timeout_s=10, reservation_ttl_s=30)
    collocated, _ = make_engine(tiny_model, "both")
    prefill = make_engine(tiny_model, "prefill", transfer, budget=64)
    decode = make_engine(tiny_model, "decode", transfer)
    turn1 = tokens(1, 40)

    async def run() -> None:
        answer, _, _ = await bidirectional(prefill, decode, f"t1-{kind}", turn1, greedy(30))
        turn2 = turn1 + answer + tokens(2, 20)  # 90 tokens; decode holds 69 of them (4 blocks)
        expected, _ = await collect(collocated.generate(generate_request(f"ref-{kind}", turn2, greedy(8))))
        out, final, prefill_out = await bidirectional(prefill, decode, f"t2-{kind}", turn2, greedy(8))
        assert out == expected
        sources = prefill_out.kv_transfer_params["prompt_sources"]
        # prefill held turn 1's prompt (2 blocks); decode lent the answer's blocks (2 more)
        assert sources["reused_tokens"] == 2 * BLOCK
        assert sources["pulled_blocks"] == 2 and sources["pulled_tokens"] == 2 * BLOCK
        assert sources["recomputed_tokens"] == len(turn2) - 4 * BLOCK
        assert sources["offered_blocks"] == 4 and sources["reuse_stopped_block"] == 4
        assert prefill_out.metrics["pulled_tokens"] == 2 * BLOCK
        assert final.kv_transfer_params["handoff"]["transferred"]
        # the pulled blocks are now in prefill's own cache: a third turn reuses them locally
        turn3 = turn2 + out + tokens(3, 20)
        expected3, _ = await collect(collocated.generate(generate_request(f"ref3-{kind}", turn3, greedy(4))))
        out3, _, prefill3 = await bidirectional(prefill, decode, f"t3-{kind}", turn3, greedy(4))
        assert out3 == expected3
        assert prefill3.kv_transfer_params["prompt_sources"]["reused_tokens"] >= 4 * BLOCK

    try:
        asyncio.run(run())
        assert decode[1].lends.active() == 0  # every lease ended once prefill had pushed
    finally:
        for engine, _ in (prefill, decode):
            engine.shutdown()
        collocated.shutdown()


def test_tenants_with_different_salts_pull_nothing_of_each_other(tiny_model):
    transfer = TransferConfig(transport="shm", mode="push", timeout_s=10, reservation_ttl_s=30)
    prefill = make_engine(tiny_model, "prefill", transfer, budget=64)
    decode = make_engine(tiny_model, "decode", transfer)
    prompt = tokens(4, 70)

    async def run() -> None:
        await bidirectional(prefill, decode, "tenant-a", prompt, greedy(4), salt="tenant-a")
        _, final, prefill_out = await bidirectional(
            prefill, decode, "tenant-b", prompt, greedy(4), salt="tenant-b"
        )
        assert final.metrics["prefix_hit_tokens"] == 0  # decode holds tenant a's blocks, not b's
        sources = prefill_out.kv_transfer_params["prompt_sources"]
        assert sources["offered_blocks"] == 0 and sources["pulled_blocks"] == 0
        assert sources["reused_tokens"] == 0

    try:
        asyncio.run(run())
    finally:
        for engine, _ in (prefill, decode):
            engine.shutdown()


def test_a_lease_lends_only_the_blocks_it_names(tiny_model):
    """The transport's source check: a reader naming the lease but other blocks is refused."""
    transfer = TransferConfig(transport="shm", mode="push", timeout_s=10, reservation_ttl_s=30)
    decode = make_engine(tiny_model, "decode", transfer)
    try:
        lends = decode[1].lends
        lend_id = lends.lend("req-1", [3, 4], ["hash-3", "hash-4"])
        is_held = decode[1].transport.is_held
        assert is_held(lend_id, [3, 4], ["hash-3", "hash-4"])
        assert not is_held(lend_id, [3, 5], ["hash-3", "hash-4"])
        assert not is_held(lend_id, [3, 4], ["hash-3", "other-tokens"])  # KV of another prompt
        assert not is_held(lend_id, [3, 4], [])
        assert not is_held("req-2@prefix", [3], ["hash-3"])
        assert not is_held("req-1@prefix-0000000000000000", [3], ["hash-3"])  # a guessed name
        decode[1].transport.on_release(lend_id)
        assert not is_held(lend_id, [3], ["hash-3"])
    finally:
        decode[0].shutdown()


def test_matching_stops_at_the_first_differing_hash():
    own = [bytes([i]) * 16 for i in range(5)]
    offered = [h.hex() for h in own[:2]] + [(b"x" * 16).hex(), own[3].hex()]
    assert matched_prefix_blocks(own, offered, 5) == 2
    assert matched_prefix_blocks(own, [h.hex() for h in own], 3) == 3
