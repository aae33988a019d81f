"""A seeded sampled request draws from (seed, output position): deterministic, the same
alone or in any batch, and the same when resumed after k of its tokens (prompt + those
tokens, `preceding_output_tokens=k`), as a migrated request is on another worker."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.engine.llm import LLM
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts

PROMPTS = make_prompts(2048, seed=11)[:4]
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=2026, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_blocks=128)


def test_a_resumed_seeded_request_continues_the_undisturbed_one(llm):
    whole = llm.generate([PROMPTS[0]], SEEDED)[0].token_ids
    assert llm.generate([PROMPTS[0]], SEEDED)[0].token_ids == whole
    for k in (1, 9, 23):
        resumed = dataclasses.replace(SEEDED, max_tokens=SEEDED.max_tokens - k, preceding_output_tokens=k)
        tail = llm.generate([PROMPTS[0] + whole[:k]], resumed)[0].token_ids
        assert tail == whole[k:]
    # without saying where it resumes, the request draws position 0's noise again
    restarted = dataclasses.replace(SEEDED, max_tokens=SEEDED.max_tokens - 9)
    assert llm.generate([PROMPTS[0] + whole[:9]], restarted)[0].token_ids != whole[9:]


def test_resumed_seeded_requests_are_batch_independent(llm):
    alone = [llm.generate([p], SEEDED)[0].token_ids for p in PROMPTS[:2]]
    resumed = dataclasses.replace(SEEDED, max_tokens=SEEDED.max_tokens - 5, preceding_output_tokens=5)
    unseeded = SamplingParams(max_tokens=7, temperature=0.8)
    batch = llm.generate(
        [PROMPTS[0] + alone[0][:5], PROMPTS[2], PROMPTS[1], PROMPTS[3]], [resumed, unseeded, SEEDED, unseeded]
    )
    assert batch[0].token_ids == alone[0][5:]
    assert batch[2].token_ids == alone[1]


@pytest.mark.parametrize("value", [-1, 2**31, 1.5, "3", True])
def test_preceding_output_tokens_must_be_a_small_non_negative_integer(value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"preceding_output_tokens": value})
    assert info.value.param == "preceding_output_tokens"
