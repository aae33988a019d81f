"""Encoder disaggregation without the HTTP layer: an encoder worker (vision tower only)
publishes embeddings through the shared-memory encoder-cache connector; an engine given
only image hashes loads them and its greedy tokens equal transformers'. A repeated image
is encoded once; a miss or an unreadable entry makes the engine encode it itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitserve.encoder_cache.connector import SharedMemoryECConnector
from splitserve.engine.encoder_worker import EncoderJob, EncoderWorker
from splitserve.engine.llm import LLM
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.kv_transfer import KVTransferParams
from tests.engine.vl_helpers import GREEDY
from tests.generate_requests import generate_request


def jobs_of(cases) -> list[EncoderJob]:
    return [EncoderJob(i.image_hash, i.grid_thw, i.pixel_values) for case in cases for i in case.images]


def without_pixels(case):
    return [dataclasses.replace(image, pixel_values=None) for image in case.images] or None


def test_engine_loads_what_the_encoder_worker_encoded(vl_model, vl_cases, tmp_path):
    cases, expected = vl_cases
    encoder = EncoderWorker(vl_model, SharedMemoryECConnector(tmp_path), dtype="float32")
    jobs = jobs_of(cases) + jobs_of(cases[:1])  # the first case's image twice
    results = encoder.encode(jobs)
    assert encoder.num_images_encoded == 7 and encoder.num_cache_hits == 1
    assert [r.cached for r in results] == [False] * 7 + [True]
    assert [r.num_tokens for r in results[:7]] == [n for case in cases for n in case.num_visual_tokens]
    assert encoder.encode(jobs_of(cases[1:2]))[0].cached  # later requests: no encoder work
    assert encoder.num_images_encoded == 7

    # prefill/decode gets hashes and placements only, no pixels
    llm = LLM(vl_model, num_blocks=128, ec_connector=SharedMemoryECConnector(tmp_path))
    results = llm.generate([c.token_ids for c in cases], GREEDY, images=[without_pixels(c) for c in cases])
    assert [r.token_ids for r in results] == expected
    assert llm.engine.multimodal.num_images_encoded == 0
    assert llm.engine.multimodal.num_images_loaded == 7


def test_a_miss_is_encoded_by_the_engine_and_published(vl_model, vl_cases, tmp_path):
    cases, expected = vl_cases
    connector = SharedMemoryECConnector(tmp_path)
    llm = LLM(vl_model, num_blocks=128, ec_connector=connector)
    with pytest.raises(InvalidRequestError, match="no pixels and is in no encoder cache"):
        llm.engine.add_request(
            generate_request("lost", cases[0].token_ids, GREEDY, images=without_pixels(cases[0]))
        )
    # with pixels: the engine encodes the image itself (slower, never lost) and publishes it
    assert llm.generate([cases[0].token_ids], GREEDY, images=[cases[0].images])[0].token_ids == expected[0]
    assert llm.engine.multimodal.num_images_encoded == 1
    assert connector.has_cache(cases[0].images[0].image_hash)

    # an unreadable entry, or one of the wrong shape, is a miss too: a fresh engine falls
    # back to its own encoder and its result replaces the bad entry
    broken, wrong_shape = cases[1].images
    (tmp_path / f"{broken.image_hash}.ec").write_bytes(b"\x05\x00\x00\x00garbage")
    connector.save_cache(wrong_shape.image_hash, torch.zeros(3, 5))
    fresh = LLM(vl_model, num_blocks=128, ec_connector=connector)
    assert fresh.generate([cases[1].token_ids], GREEDY, images=[cases[1].images])[0].token_ids == expected[1]
    assert fresh.engine.multimodal.num_images_encoded == 2 and fresh.engine.multimodal.num_images_loaded == 0
    for image in cases[1].images:  # replaced by the recomputed embeddings
        assert connector.load_cache(image.image_hash, fresh.engine.device) is not None


def test_image_hashes_never_name_paths(vl_model, vl_cases, tmp_path):
    cases, _ = vl_cases
    connector = SharedMemoryECConnector(tmp_path / "ec")
    with pytest.raises(ValueError, match="hex"):
        connector.has_cache("../../etc/passwd")
    encoder = EncoderWorker(vl_model, connector, dtype="float32")
    image = cases[0].images[0]
    with pytest.raises(InvalidRequestError) as error:
        encoder.encode([EncoderJob("../" + image.image_hash, image.grid_thw, image.pixel_values)])
    assert error.value.param == "image_hash"
    with pytest.raises(InvalidRequestError) as error:
        encoder.encode([EncoderJob(image.image_hash, (1, 2, 2), image.pixel_values)])
    assert error.value.param == "pixel_values"
    assert encoder.num_images_encoded == 0 and not any((tmp_path / "ec").iterdir())


def test_encoder_cache_across_hosts_over_tcp(vl_model, vl_cases, tmp_path):
    """The encoder host serves its cache (token-protected); a worker elsewhere publishes
    into it and an engine elsewhere loads from it; a wrong token or a dead server is a miss."""
    from splitserve.encoder_cache.tcp import ECServer, TcpECConnector

    cases, expected = vl_cases
    server = ECServer(SharedMemoryECConnector(tmp_path), token="internal-secret")
    try:
        remote = TcpECConnector("127.0.0.1", server.port, token="internal-secret")
        encoder = EncoderWorker(vl_model, remote, dtype="float32")
        encoder.encode(jobs_of(cases[:3]))
        assert encoder.num_images_encoded == 7
        assert all((tmp_path / f"{image.image_hash}.ec").is_file() for case in cases for image in case.images)

        llm = LLM(
            vl_model, num_blocks=128, ec_connector=TcpECConnector("127.0.0.1", server.port, "internal-secret")
        )
        results = llm.generate(
            [c.token_ids for c in cases], GREEDY, images=[without_pixels(c) for c in cases]
        )
        assert [r.token_ids for r in results] == expected
        assert llm.engine.multimodal.num_images_loaded == 7 and llm.engine.multimodal.num_images_encoded == 0

        intruder = TcpECConnector("127.0.0.1", server.port, token="guess")
        assert not intruder.has_cache(cases[0].images[0].image_hash)
        assert intruder.load_cache(cases[0].images[0].image_hash, torch.device("cpu")) is None
        with pytest.raises(OSError, match="did not store"):
            intruder.save_cache("ee" * 32, torch.zeros(2, 2))
        assert not (tmp_path / f"{'ee' * 32}.ec").exists()
        for connector in (remote, intruder):
            connector.shutdown()
        llm.engine.shutdown()
    finally:
        server.close()

    # the server is gone: a miss after the timeout; with pixels the engine encodes itself
    dead = TcpECConnector("127.0.0.1", server.port, "internal-secret", timeout_s=0.2)
    fallback = LLM(vl_model, num_blocks=128, ec_connector=dead)
    assert (
        fallback.generate([cases[0].token_ids], GREEDY, images=[cases[0].images])[0].token_ids == expected[0]
    )
    assert fallback.engine.multimodal.num_images_encoded == 1
    fallback.engine.shutdown()


def test_encoder_prefill_decode(vl_model, vl_cases, tmp_path):
    """`up --encoder 1 --prefill 1 --decode 1` without HTTP: the proxy's flow sends each
    request's images to the encoder worker, then the request with hashes and placements
    only to decode (reserving blocks) and prefill (pushing KV layer by layer); decode's
    greedy tokens equal transformers', and neither engine runs the vision tower."""
    import asyncio

    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, TransferConfig
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.kv.connector.pd_base import PDConnector
    from splitserve.kv.connector.pd_connector import make_pd_connector

    cases, expected = vl_cases
    EncoderWorker(vl_model, SharedMemoryECConnector(tmp_path), dtype="float32").encode(jobs_of(cases))

    def start(role: str) -> tuple[AsyncEngine, PDConnector]:
        config = EngineConfig(ModelConfig(vl_model), CacheConfig(num_blocks=128), role=role)
        connector = make_pd_connector(role, TransferConfig())
        engine = AsyncEngine(config, connector=connector, ec_connector=SharedMemoryECConnector(tmp_path))
        return engine.start(), connector

    async def collect(outputs) -> list[int]:
        return [token async for output in outputs for token in output.new_token_ids]

    async def pd_generate(request_id: str, case) -> list[int]:
        images = without_pixels(case)
        decoding = asyncio.ensure_future(
            collect(
                decode.generate(
                    generate_request(
                        request_id,
                        case.token_ids,
                        GREEDY,
                        kv_transfer_params={"do_remote_prefill": True},
                        images=images,
                    ),
                )
            )
        )
        reservation = await asyncio.to_thread(decode_connector.reservations.wait, request_id, 30)
        kv = {
            "do_remote_decode": True,
            "transfer_mode": "push",
            "remote_request_id": request_id,
            "remote_block_ids": reservation.block_ids,
            "remote_first_block": reservation.first_block,
            **KVTransferParams().with_address(decode_connector.kv_address()).to_wire(),
        }
        await collect(
            prefill.generate(
                generate_request(
                    request_id + "-p", case.token_ids, GREEDY, kv_transfer_params=kv, images=images
                )
            )
        )
        return await decoding

    (prefill, _), (decode, decode_connector) = start("prefill"), start("decode")
    try:
        outputs = [asyncio.run(pd_generate(f"r{i}", case)) for i, case in enumerate(cases)]
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert outputs == expected
    for engine in (prefill, decode):
        assert engine.engine.multimodal.num_images_encoded == 0
    assert prefill.engine.multimodal.num_images_loaded == 7
