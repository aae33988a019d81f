"""Tokenizer: segment-cached encoding equals whole-string encoding; vocabulary helpers."""

from __future__ import annotations

import json
import shutil
import threading
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.frontend.chat_template import load_chat_template
from splitserve.frontend.tokenizer import SegmentCache, Tokenizer

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
PIECES = [
    *ADDED,
    "<|im",  # prefixes of added tokens, as plain text
    "<think",
    "</",
    "|>",
    "hello",
    " world",
    "  ",
    " ",
    "\n",
    "\n\n",
    "\t",
    "user",
    "assistant",
    "café",
    "東京",
    "🙂",
    "🦜",
    "Größe",
    '{"name": "f"}',
    "123",
    "'s",
    "’",
]
texts = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(max_size=6)),
    max_size=24,
).map("".join)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_segmented_encode_equals_whole_string(tokenizer, text):
    whole = tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text) == whole
    assert tokenizer.encode(text) == whole  # second time from the cache


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_encode_equals_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_growing_conversation_tokenizes_only_new_text(tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    assert tokenizer.segmented
    template = load_chat_template(tiny_model)
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    for turn in range(40):
        messages.append({"role": "user", "content": f"Question number {turn}: what about {turn * 7}?"})
        text = template.render(messages, add_generation_prompt=True)
        misses_before = tokenizer.cache.misses
        ids = tokenizer.encode(text)
        new_pieces = tokenizer.cache.misses - misses_before
        assert ids == tokenizer.backend.encode(text, add_special_tokens=False).ids
        if turn > 0:
            # only the new user message and the new assistant header piece are new text
            assert new_pieces <= 3, (turn, new_pieces)
        messages.append({"role": "assistant", "content": f"Answer {turn}, with some words. " * 3})
    assert tokenizer.cache.hits > 40 * 20


def test_vocabulary_helpers(tokenizer, tiny_model):
    config = json.loads(Path(tiny_model, "config.json").read_text())
    im_end, eot = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token_ids == frozenset({im_end, eot})
    assert tokenizer.vocab_size == config["vocab_size"]
    assert tokenizer.special_token_ids == frozenset(tokenizer.token_to_id(t) for t in ADDED[:3])
    assert tokenizer.added_token_ids == frozenset(tokenizer.token_to_id(t) for t in ADDED)
    ids = tokenizer.encode("<|im_start|>user\nhi <think>x</think><|im_end|>")
    assert tokenizer.decode(ids) == "user\nhi <think>x</think>"  # non-special added tokens survive
    assert (
        tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi <think>x</think><|im_end|>"
    )
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<|im_start|>", "user"]
    assert tokenizer.id_to_token(im_end) == "<|im_end|>"
    assert tokenizer.token_to_id("definitely not a token") is None
    with pytest.raises(TypeError):
        tokenizer.encode(None)  # type: ignore[arg-type]


def test_token_bytes_match_decode(tokenizer):
    assert tokenizer.byte_level
    for token_id in range(tokenizer.vocab_size):
        expected = tokenizer.decode([token_id], skip_special_tokens=False)
        assert tokenizer.token_bytes(token_id).decode("utf-8", "replace") == expected
    assert tokenizer.token_bytes(10**6) == b""


def test_threads_share_one_tokenizer(tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    texts = [f"<|im_start|>user\nthread text {i} café<|im_end|>\n" * (i % 5 + 1) for i in range(40)]
    expected = [tokenizer.backend.encode(t, add_special_tokens=False).ids for t in texts]
    errors: list[str] = []

    def work(offset: int) -> None:
        for k in range(200):
            i = (k + offset) % len(texts)
            if tokenizer.encode(texts[i]) != expected[i]:
                errors.append(texts[i])

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


def test_segment_cache_is_bounded():
    cache = SegmentCache(max_entries=3, max_chars=10)
    for piece in ("aa", "bb", "cc"):
        cache.put(piece, array("i", [1]))
    assert cache.get("aa") == array("i", [1])  # now most recent
    cache.put("dd", array("i", [2]))
    assert len(cache) == 3 and cache.get("bb") is None and cache.get("aa") == array("i", [1])
    cache.put("0123456789", array("i", [3]))  # exceeds the character budget together with the rest
    assert len(cache) == 1 and cache.get("0123456789") == array("i", [3])
    cache.put("x" * 11, array("i", [4]))  # larger than the whole budget: not cached
    assert cache.get("x" * 11) is None


def test_tokenizer_whose_added_tokens_strip_whitespace_encodes_whole_strings(tiny_model, tmp_path):
    """An added token with lstrip/rstrip absorbs neighbouring spaces: pieces would differ, so
    such tokenizers encode the whole string (still correct, just not cached)."""
    directory = tmp_path / "lstrip"
    directory.mkdir()
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(Path(tiny_model, name), directory / name)
    spec = json.loads(Path(tiny_model, "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["content"] == "<think>":
            token["lstrip"] = token["rstrip"] = True
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.from_dir(str(directory))
    assert not tokenizer.segmented
    text = "a  <think>  b <|im_end|> c"
    assert tokenizer.encode(text) == tokenizer.backend.encode(text, add_special_tokens=False).ids


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(str(tmp_path))
