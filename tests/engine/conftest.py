"""Fixtures of the vision-language engine tests: the tiny Qwen2-VL and its oracle cases."""

from __future__ import annotations

import pytest

from tests.engine.vl_helpers import VLCase, transformers_greedy


@pytest.fixture(scope="session")
def vl_model(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen2_vl")


@pytest.fixture(scope="session")
def vl_cases(vl_model) -> tuple[list[VLCase], list[list[int]]]:
    """Prompts with 1, 2 and 4 images of different sizes and one text-only, and
    transformers' greedy tokens for each."""
    cases = [
        VLCase(vl_model, [(90, 130)], seed=1),
        VLCase(vl_model, [(200, 120), (56, 56)], seed=2),
        VLCase(vl_model, [(64, 300), (150, 150), (57, 90), (260, 70)], seed=3),
        VLCase(vl_model, [], seed=4),
    ]
    return cases, transformers_greedy(vl_model, cases)
