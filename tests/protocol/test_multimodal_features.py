"""The `features` wire object: round trip, float16 halving, byte limit, malformed input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.protocol.multimodal import (
    FeaturesError,
    ImageInput,
    features_from_wire,
    features_to_wire,
    features_without_pixels,
)

PIXELS = np.random.default_rng(0).standard_normal((16, 1176)).astype(np.float32)
IMAGES = [ImageInput("ab" * 32, 5, (1, 4, 4), PIXELS), ImageInput("cd" * 32, 30, (1, 2, 2), None)]


def test_round_trip_through_json():
    wire = json.loads(json.dumps(features_to_wire(IMAGES, merge=2)))
    assert wire["mm_placeholders"]["image"] == [{"offset": 5, "length": 4}, {"offset": 30, "length": 1}]
    assert wire["kwargs_data"]["image"][1]["pixel_values"] is None  # hash only: the encoder cache has it
    back = features_from_wire(wire, max_pixel_bytes=PIXELS.nbytes)
    assert [(i.image_hash, i.offset, i.grid_thw) for i in back] == [
        (i.image_hash, i.offset, i.grid_thw) for i in IMAGES
    ]
    assert np.array_equal(back[0].pixel_values, PIXELS) and back[1].pixel_values is None


def test_float16_halves_the_payload_and_the_limit_is_413():
    full = json.dumps(features_to_wire(IMAGES[:1], merge=2))
    half = features_to_wire(IMAGES[:1], merge=2, pixel_dtype="float16")
    assert len(json.dumps(half)) < 0.55 * len(full)
    back = features_from_wire(half, max_pixel_bytes=PIXELS.nbytes // 2)
    assert back[0].pixel_values.dtype == np.float32
    assert np.allclose(back[0].pixel_values, PIXELS, atol=2e-3)
    with pytest.raises(FeaturesError, match="max_pixel_bytes") as error:
        features_from_wire(half, max_pixel_bytes=PIXELS.nbytes // 2 - 1)
    assert error.value.too_large


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w.pop("mm_hashes"),
        lambda w: w["mm_placeholders"]["image"].pop(),
        lambda w: w["kwargs_data"]["image"][0].update(grid_thw=[1, 4]),
        lambda w: w["kwargs_data"]["image"][0]["pixel_values"].update(dtype="int8"),
        lambda w: w["kwargs_data"]["image"][0]["pixel_values"].update(data="@@@"),
        lambda w: w["kwargs_data"]["image"][0]["pixel_values"].update(shape=[16, 1175]),
        lambda w: w["mm_hashes"].update(image=[5, "cd" * 32]),
    ],
)
def test_malformed_features_are_400(mutate):
    wire = features_to_wire(IMAGES, merge=2)
    mutate(wire)
    with pytest.raises(FeaturesError) as error:
        features_from_wire(wire, max_pixel_bytes=2**30)
    assert not error.value.too_large


def test_features_without_pixels_keep_hashes_and_placements():
    wire = features_to_wire(IMAGES, merge=2)
    stripped = features_without_pixels(wire)
    assert wire["kwargs_data"]["image"][0]["pixel_values"] is not None  # the original is untouched
    back = features_from_wire(json.loads(json.dumps(stripped)), max_pixel_bytes=0)
    assert [(i.image_hash, i.offset, i.grid_thw, i.pixel_values) for i in back] == [
        (i.image_hash, i.offset, i.grid_thw, None) for i in IMAGES
    ]
    assert len(json.dumps(stripped)) < 1000
