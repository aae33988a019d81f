"""Sampling through the public Python API: seeds, top-k/top-p, stops, logprobs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts, oracle_log_softmax

PROMPTS = make_prompts(2048, seed=3)[:4]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_blocks=64)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    batched = llm.generate(PROMPTS, [params, *[SamplingParams(max_tokens=5, temperature=0.7)] * 3])[0]
    assert batched.token_ids == alone
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone
    assert alone != llm.generate([PROMPTS[0]], greedy(16))[0].token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    expected = [r.token_ids for r in llm.generate(PROMPTS, greedy())]
    top_k = SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True, seed=5)
    top_p = SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True, seed=5)
    assert [r.token_ids for r in llm.generate(PROMPTS, top_k)] == expected
    assert [r.token_ids for r in llm.generate(PROMPTS, top_p)] == expected


def test_top_k_keeps_sampled_tokens_among_the_k_best(llm, tiny_model):
    params = SamplingParams(max_tokens=20, temperature=5.0, top_k=3, seed=7, ignore_eos=True, logprobs=3)
    result = llm.generate([PROMPTS[1]], params)[0]
    for entry in result.logprobs:
        assert entry["token_id"] in [t for t, _ in entry["top_logprobs"]]


def test_max_tokens_and_stop_token_ids(llm):
    base = llm.generate([PROMPTS[2]], greedy(10))[0]
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    stopped = llm.generate([PROMPTS[2]], greedy(10, stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == base.token_ids[: first + 1]  # the stop token is included
    assert stopped.finish_reason == "stop"


def test_logprobs_equal_oracle_log_softmax(llm, tiny_model):
    prompt = PROMPTS[1]
    result = llm.generate([prompt], greedy(8, logprobs=5))[0]
    reference = oracle_log_softmax(tiny_model, prompt, result.token_ids)
    assert len(result.logprobs) == 8
    for i, entry in enumerate(result.logprobs):
        assert entry["token_id"] == result.token_ids[i]
        assert entry["logprob"] == pytest.approx(reference[i, entry["token_id"]].item(), abs=1e-4)
        values, ids = reference[i].topk(5)
        assert [t for t, _ in entry["top_logprobs"]] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in entry["top_logprobs"]]), values, atol=1e-4)
    zero = llm.generate([prompt], greedy(3, logprobs=0))[0]
    assert all(e["top_logprobs"] == [] for e in zero.logprobs)
    assert llm.generate([prompt], greedy(3))[0].logprobs is None


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """The tiny model with its EOS moved to a token greedy decoding emits, so EOS
    handling (read from config.json and generation_config.json) can be observed."""
    probe = LLM(tiny_model, num_blocks=64).generate([PROMPTS[3]], greedy(12))[0].token_ids
    eos = probe[5]
    target = Path(tmp_path_factory.mktemp("eos-model"))
    shutil.copytree(tiny_model, target, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((target / name).read_text())
        data["eos_token_id"] = eos if name == "config.json" else [eos]
        (target / name).write_text(json.dumps(data))
    return str(target), eos, probe


def test_eos_stops_unless_ignored(eos_model):
    model_dir, eos, probe = eos_model
    llm = LLM(model_dir, num_blocks=64)
    assert eos in llm.engine.model_info.eos_token_ids
    stopped = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert stopped.token_ids == probe[: probe.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    ignored = llm.generate([PROMPTS[3]], greedy(12))[0]
    assert ignored.token_ids == probe and ignored.finish_reason == "length"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_sampling_params_from_dict_names_the_bad_field(data, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(data)
    assert info.value.param == field
    assert field in str(info.value)


def test_sampling_params_from_dict_accepts_valid_values():
    params = SamplingParams.from_dict(
        {"max_tokens": 3, "temperature": 0, "top_p": 0.5, "top_k": 0, "seed": 1, "stop_token_ids": [2]}
    )
    assert params == SamplingParams(
        max_tokens=3, temperature=0.0, top_p=0.5, top_k=0, seed=1, stop_token_ids=(2,)
    )
    assert params.greedy
    assert SamplingParams.from_dict({"logprobs": None, "seed": None}) == SamplingParams()
