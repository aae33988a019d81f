"""Images over the engine HTTP APIs: the encoder role's `/inference/v1/encode` publishes
embeddings to the shared encoder cache, and `/inference/v1/generate` with `features`
(hashes and placements only) gives transformers' greedy tokens without running the
engine's vision tower; bad features are 400/413 naming the problem."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from splitserve.engine.api import cli as engine_cli
from splitserve.engine.api.app import create_engine_app
from splitserve.engine.api.encode_routes import ENCODE_PATH, ECSetup, create_encoder_app
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.encoder_worker import EncoderWorker
from splitserve.encoder_cache.connector import SharedMemoryECConnector
from splitserve.protocol.multimodal import features_to_wire, features_without_pixels
from tests.conftest import free_port
from tests.engine.api.helpers import (
    GENERATE,
    asgi_client,
    assert_openai_error,
    engine_config,
    metric_samples,
    run,
)
from tests.engine.vl_helpers import MAX_TOKENS

MERGE = 2  # the tiny Qwen2-VL's spatial merge size
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ec_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="module")
def vl_engine(vl_model, ec_dir):
    engine = AsyncEngine(engine_config(vl_model), ec_connector=SharedMemoryECConnector(ec_dir))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def generate_body(case, features: dict | None) -> dict:
    return {"token_ids": case.token_ids, "sampling_params": GREEDY, "features": features}


def test_encode_then_generate_by_hash_equals_transformers(vl_model, vl_cases, vl_engine, ec_dir):
    cases, expected = vl_cases
    encoder_app = create_encoder_app(
        EncoderWorker(vl_model, SharedMemoryECConnector(ec_dir), dtype="float32")
    )
    engine_app = create_engine_app(vl_engine)

    async def scenario():
        async with asgi_client(encoder_app) as encoder, asgi_client(engine_app) as engine:
            answers, outputs = [], []
            for case in cases[:2]:
                features = features_to_wire(case.images, MERGE)
                answers.append((await encoder.post(ENCODE_PATH, json={"features": features})).json())
                response = await engine.post(
                    GENERATE, json=generate_body(case, features_without_pixels(features))
                )
                assert response.status_code == 200, response.text
                outputs.append(response.json()["choices"][0]["token_ids"])
            again = await encoder.post(
                ENCODE_PATH, json={"features": features_to_wire(cases[0].images, MERGE)}
            )
            return (
                answers,
                outputs,
                again.json(),
                (await encoder.get("/metrics")).text,
                (await engine.get("/metrics")).text,
            )

    answers, outputs, again, encoder_metrics, engine_metrics = run(scenario())
    assert outputs == expected[:2]
    params = answers[1]["ec_transfer_params"]
    assert params["mm_hashes"] == [image.image_hash for image in cases[1].images]
    assert params["num_tokens"] == cases[1].num_visual_tokens and params["cached"] == [False, False]
    assert again["ec_transfer_params"]["cached"] == [True]  # the same image again: not re-encoded
    assert metric_samples(encoder_metrics)[("splitserve_images_encoded_total", ())] == 3
    samples = metric_samples(engine_metrics)
    assert samples[("splitserve_images_encoded_total", ())] == 0
    assert samples[("splitserve_images_loaded_total", ())] == 3


def test_bad_features_are_400_or_413_and_the_engine_keeps_serving(vl_model, vl_cases, vl_engine):
    cases, expected = vl_cases
    case = cases[0]
    features = features_to_wire(case.images, MERGE)
    small_app = create_engine_app(vl_engine, max_pixel_bytes=1000)
    unknown = dataclasses.replace(case.images[0], image_hash="ab" * 32, pixel_values=None)

    async def scenario():
        async with asgi_client(small_app) as engine:
            too_big = await engine.post(GENERATE, json=generate_body(case, features))
            malformed = await engine.post(GENERATE, json=generate_body(case, {"mm_hashes": 3}))
            not_cached = await engine.post(
                GENERATE, json=generate_body(case, features_to_wire([unknown], MERGE))
            )
            text_only = await engine.post(GENERATE, json=generate_body(cases[3], None))
            return too_big, malformed, not_cached, text_only

    too_big, malformed, not_cached, text_only = run(scenario())
    assert "max_pixel_bytes=1000" in assert_openai_error(too_big, 413, "features")["message"]
    assert_openai_error(malformed, 400, "features")
    assert "encoder cache" in assert_openai_error(not_cached, 400)["message"]
    assert text_only.json()["choices"][0]["token_ids"] == expected[3]


def test_the_encoder_refuses_what_it_cannot_encode(vl_model, vl_cases, tmp_path):
    cases, _ = vl_cases
    app = create_encoder_app(EncoderWorker(vl_model, SharedMemoryECConnector(tmp_path), dtype="float32"))
    features = features_to_wire(cases[0].images, MERGE)

    async def scenario():
        async with asgi_client(app) as encoder:
            no_pixels = await encoder.post(ENCODE_PATH, json={"features": features_without_pixels(features)})
            no_images = await encoder.post(ENCODE_PATH, json={"features": None})
            unknown_field = await encoder.post(ENCODE_PATH, json={"features": features, "x": 1})
            bad_hash = await encoder.post(
                ENCODE_PATH, json={"features": {**features, "mm_hashes": {"image": ["../x" * 8]}}}
            )
            fine = await encoder.post(ENCODE_PATH, json={"features": features})
            return no_pixels, no_images, unknown_field, bad_hash, fine

    no_pixels, no_images, unknown_field, bad_hash, fine = run(scenario())
    assert_openai_error(no_pixels, 400, "features")
    assert_openai_error(no_images, 400, "features")
    assert_openai_error(unknown_field, 400, "x")
    assert_openai_error(bad_hash, 400, "image_hash")
    assert fine.status_code == 200 and fine.json()["ec_transfer_params"]["cached"] == [False]


def test_ec_flags_share_a_host_cache_with_another_host(tmp_path):
    """--ec-shm-dir with --ec-serve-port serves the cache; --ec-remote reaches it."""
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    port = free_port()
    serving = ECSetup(parser.parse_args(["--ec-shm-dir", str(tmp_path), "--ec-serve-port", str(port)]), False)
    remote = ECSetup(parser.parse_args(["--ec-remote", f"127.0.0.1:{port}"]), False)
    try:
        image_hash, embeddings = "cd" * 32, torch.arange(12.0).view(3, 4)
        remote.connector.save_cache(image_hash, embeddings)  # another host publishes
        assert serving.connector.has_cache(image_hash)
        assert torch.equal(remote.connector.load_cache(image_hash, torch.device("cpu")), embeddings)
        assert ECSetup(parser.parse_args([]), False).connector is None  # no flags: no shared cache
        with pytest.raises(ValueError, match="--ec-shm-dir"):
            ECSetup(parser.parse_args(["--ec-serve-port", str(free_port())]), False)
    finally:
        remote.connector.shutdown()
        serving.close()
