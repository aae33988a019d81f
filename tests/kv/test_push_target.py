"""Push with the target pending: a prefill request computes before decode has reserved
anything, and its KV still reaches decode once the reservation is forwarded to it
(`LayerPusher.set_target`), whether the target comes after the prefill finished (its
blocks parked) or before the prefill was admitted."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.config import TransferConfig
from splitserve.protocol.kv_transfer import KVTransferParams
from tests.generate_requests import generate_request
from tests.kv.test_pd_connector import GREEDY, collect, make_engine, prompt

PENDING = {"do_remote_decode": True, "transfer_mode": "push", "push_target_pending": True}


def target_of(decode_connector, reservation) -> KVTransferParams:
    return KVTransferParams(
        do_remote_decode=True,
        transfer_mode="push",
        remote_request_id=reservation.request_id,
        remote_block_ids=tuple(reservation.block_ids),
        remote_first_block=reservation.first_block,
    ).with_address(decode_connector.kv_address())


@pytest.fixture(scope="module")
def engines(tiny_model):
    transfer = TransferConfig(transport="shm", mode="push", timeout_s=10, reservation_ttl_s=30)
    collocated = make_engine(tiny_model, "both")[0]
    prefill = make_engine(tiny_model, "prefill", transfer, budget=64)  # chunked: several steps
    decode = make_engine(tiny_model, "decode", transfer)
    yield collocated, prefill, decode
    for engine in (collocated, prefill[0], decode[0]):
        engine.shutdown()


def test_prefill_finished_before_the_reservation_still_hands_its_kv_over(engines):
    collocated, (prefill, pconn), (decode, dconn) = engines
    tokens = prompt(11, 150)

    async def run() -> None:
        expected, _ = await collect(collocated.generate(generate_request("ref-parked", tokens, GREEDY)))
        # prefill runs to its end with no destination: its blocks are kept for one
        _, prefill_final = await collect(
            prefill.generate(generate_request("parked-p", tokens, GREEDY, kv_transfer_params=PENDING))
        )
        assert prefill_final.kv_transfer_params["push_target_pending"] is True
        assert "kv_transfer_error" not in prefill_final.kv_transfer_params
        wait_for_kv = {"do_remote_prefill": True}
        task = asyncio.ensure_future(
            collect(
                decode.generate(generate_request("parked", tokens, GREEDY, kv_transfer_params=wait_for_kv))
            )
        )
        reservation = await asyncio.to_thread(dconn.reservations.wait, "parked", 30)
        assert reservation is not None and reservation.block_ids
        answer = await asyncio.to_thread(pconn.pusher.set_target, "parked-p", target_of(dconn, reservation))
        assert answer.status == "sent"
        assert answer.outcome is not None and answer.outcome.error is None and answer.outcome.num_bytes > 0
        out, final = await task
        assert out == expected
        assert final.kv_transfer_params["handoff"]["transferred"]
        assert pconn.pusher.set_target("parked-p", target_of(dconn, reservation)).status == "early"  # gone
        assert pconn.pusher.cancel("parked-p")

    asyncio.run(run())


def test_a_target_that_arrives_before_the_prefill_is_taken_by_it(engines):
    collocated, (prefill, pconn), (decode, dconn) = engines
    tokens = prompt(12, 90)

    async def run() -> None:
        expected, _ = await collect(collocated.generate(generate_request("ref-early", tokens, GREEDY)))
        wait_for_kv = {"do_remote_prefill": True}
        task = asyncio.ensure_future(
            collect(
                decode.generate(generate_request("early", tokens, GREEDY, kv_transfer_params=wait_for_kv))
            )
        )
        reservation = await asyncio.to_thread(dconn.reservations.wait, "early", 30)
        assert reservation is not None
        assert pconn.pusher.set_target("early-p", target_of(dconn, reservation)).status == "early"
        _, prefill_final = await collect(
            prefill.generate(generate_request("early-p", tokens, GREEDY, kv_transfer_params=PENDING))
        )
        assert "push_target_pending" not in prefill_final.kv_transfer_params
        assert prefill_final.kv_transfer_params.get("kv_bytes", 0) > 0
        out, _ = await task
        assert out == expected

    asyncio.run(run())


def test_a_cancelled_target_frees_a_parked_prefill(engines):
    _, (prefill, pconn), _ = engines

    async def run() -> None:
        _, final = await collect(
            prefill.generate(generate_request("gone-p", prompt(13, 70), GREEDY, kv_transfer_params=PENDING))
        )
        assert final.kv_transfer_params["push_target_pending"] is True

    asyncio.run(run())
    assert pconn.pusher.cancel("gone-p")
    assert not pconn.pusher.cancel("gone-p")
