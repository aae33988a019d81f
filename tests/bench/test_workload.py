"""Workloads: exact prompt lengths with the model's own tokenizer, prefix groups, datasets."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer

from splitserve.bench.load import LoadSpec
from splitserve.bench.runner import local_tokenizer
from splitserve.bench.workload import (
    PromptFactory,
    SessionFactory,
    SyntheticSpec,
    Tokenizer,
    load_dataset,
)
from splitserve.goodput import Lengths, interarrival_times


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


def test_prompts_have_exact_token_lengths(tiny_model, tokenizer):
    oracle = HFTokenizer.from_file(f"{tiny_model}/tokenizer.json")  # counted independently
    prompts = PromptFactory(tokenizer, seed=3)
    for length in (1, 2, 17, 256, 1000):
        text = prompts.text(length)
        assert len(oracle.encode(text, add_special_tokens=False).ids) == length
    assert prompts.text(64) != prompts.text(64)


def test_synthetic_sessions_lengths_and_prefix_groups(tokenizer):
    prompts = PromptFactory(tokenizer, seed=0)
    spec = SyntheticSpec(Lengths.parse("20:40"), Lengths.parse("5:9"), prefix_len=32, num_prefix_groups=3)
    workload = SessionFactory(prompts, spec, seed=0)
    sessions = [workload.session(i) for i in range(12)]
    for session in sessions:
        (turn,) = session.turns
        assert 52 <= turn.user_tokens <= 72 and 5 <= turn.max_tokens <= 9
        assert tokenizer.count(turn.user_text) == turn.user_tokens
    prefix_of = [" ".join(s.turns[0].user_text.split()[:32]) for s in sessions]
    assert len(set(prefix_of)) == 3
    assert all(prefix_of[i] == prefix_of[i % 3] for i in range(12))  # round-robin groups
    assert len({s.turns[0].user_text for s in sessions}) == 12  # unique suffixes


def test_multi_turn_sessions_have_one_turn_per_request(tokenizer):
    spec = SyntheticSpec(Lengths.fixed(8), Lengths.fixed(4), turns=3)
    session = SessionFactory(PromptFactory(tokenizer, 0), spec, seed=0).session(0)
    assert len(session.turns) == 3 and all(t.user_tokens == 8 for t in session.turns)


def test_length_range_parse():
    assert Lengths.parse("64") == Lengths.fixed(64)
    assert Lengths.parse("64:256") == Lengths("uniform", 64, 256)
    rng = random.Random(0)
    assert {Lengths("uniform", 3, 5).sample(rng) for _ in range(200)} == {3, 4, 5}
    for bad in ("0", "10:5", "a", "1:b", "-3"):
        with pytest.raises(ValueError, match="bad lengths"):
            Lengths.parse(bad)


def test_length_mixture_parse_sample_and_mean():
    # The headline's workload: chats of 64-256 tokens with 10% long prompts among them.
    mix = Lengths.parse("64:256,10%2048:3072")
    assert mix == Lengths.mixture([(0.9, Lengths("uniform", 64, 256)), (0.1, Lengths("uniform", 2048, 3072))])
    assert Lengths.parse(str(mix)) == mix and str(mix) == "90%64:256,10%2048:3072"
    assert mix.mean() == pytest.approx(0.9 * 160 + 0.1 * 2560)
    rng = random.Random(0)
    draws = [mix.sample(rng) for _ in range(2000)]
    assert all(64 <= d <= 256 or 2048 <= d <= 3072 for d in draws)
    assert 150 <= sum(d >= 2048 for d in draws) <= 250  # ~10%, seeded
    assert Lengths.parse("8,16").parts == ((0.5, Lengths.fixed(8)), (0.5, Lengths.fixed(16)))
    for bad in ("64,110%5", "50%64,40%8", "64,100%8", "x%5,6", "64,"):
        with pytest.raises(ValueError, match="bad"):
            Lengths.parse(bad)


def test_dataset_formats(tmp_path, tokenizer):
    path = tmp_path / "chats.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]},
        {
            "conversations": [
                {"from": "human", "value": "what is the time"},
                {"from": "gpt", "value": "noon today"},
            ]
        },
        {"prompt": "once upon a time", "max_tokens": 7},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    prompts = PromptFactory(tokenizer, 0)
    sessions = load_dataset(path, prompts, Lengths.fixed(11), seed=0)
    by_text = {s.turns[0].user_text: s for s in sessions}
    assert set(by_text) == {"hello there", "what is the time", "once upon a time"}
    assert by_text["hello there"].history == ({"role": "system", "content": "be brief"},)
    assert by_text["hello there"].turns[0].max_tokens == 11  # from --output-len
    assert by_text["what is the time"].turns[0].max_tokens == tokenizer.count("noon today")  # recorded answer
    assert by_text["once upon a time"].turns[0].max_tokens == 7
    workload = SessionFactory(prompts, SyntheticSpec(Lengths.fixed(1), Lengths.fixed(1)), 0, sessions)
    assert [workload.session(i).turns[0].user_text for i in range(6)] == [
        s.turns[0].user_text for s in sessions
    ] * 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "chats.jsonl:2"),
        ('{"text": "x"}', "needs 'messages'"),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "must end with a user message"),
    ],
)
def test_dataset_errors_name_the_line(tmp_path, tokenizer, line, message):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_dataset(path, PromptFactory(tokenizer, 0), Lengths.fixed(4), seed=0)


@pytest.mark.parametrize(("arrival", "cv"), [("poisson", 1.0), ("gamma", 2.0), ("constant", 0.0)])
def test_arrival_processes_have_the_asked_rate(arrival, cv):
    spec = LoadSpec(rate=5.0, arrival=arrival, burstiness=0.25 if arrival == "gamma" else 1.0)
    gaps = interarrival_times(spec.rate, random.Random(1), spec.arrival, spec.burstiness)
    sample = [next(gaps) for _ in range(20000)]
    mean = sum(sample) / len(sample)
    std = (sum((g - mean) ** 2 for g in sample) / len(sample)) ** 0.5
    assert mean == pytest.approx(0.2, rel=0.05)
    assert std / mean == pytest.approx(cv, abs=0.1)  # gamma shape k: CV = 1 / sqrt(k)


def test_load_spec_rejects_nonsense():
    for kwargs in ({"rate": 0}, {"arrival": "uniform"}, {"concurrency": 0}, {"num_requests": None}):
        with pytest.raises(ValueError):
            LoadSpec(**kwargs)
    with pytest.raises(ValueError, match="concurrency cap"):
        LoadSpec(num_requests=None, duration=5.0)


def test_tokenizer_found_from_the_servers_model_listing(tiny_model):
    # vLLM lists a local model's directory as `root`; splitserve may list the path as the id.
    assert local_tokenizer({"id": "x", "root": tiny_model}) is not None
    assert local_tokenizer({"id": tiny_model}) is not None
    assert local_tokenizer({"id": "Qwen/Qwen3-8B"}) is None
