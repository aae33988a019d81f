"""Incremental detokenizer: equals tokenizer.decode, never splits a character, stop strings."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.frontend.detokenizer import IncrementalDetokenizer
from splitserve.frontend.tokenizer import Tokenizer

FIXTURE_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SAMPLE_TEXTS = [
    "Hello world! café naïve Größe 東京 你好 🙂🦜🚀 — “quoted” <think>x</think>",
    "<|im_start|>assistant\nemoji 🧪🧬 and 🏳️‍🌈 flags<|im_end|>",
    "plain ascii text with numbers 12345 and code: def f(x): return x * 2\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace, no byte-level decoder): the generic path."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    from splitserve.model.tiny_text import corpus_lines

    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(corpus_lines(1, 800), trainer=trainer)
    directory = tmp_path_factory.mktemp("metaspace")
    backend.save(str(directory / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(str(directory))
    assert not tokenizer.byte_level
    return tokenizer


def _stream(tokenizer, ids, chunks, *, roundtrip=True, **options) -> tuple[str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, **options)
    out, at = [], 0
    for size in chunks:
        piece = detok.add_tokens(ids[at : at + size])
        assert "\ufffd" not in piece or "\ufffd" in tokenizer.decode(
            ids, options.get("skip_special_tokens", True)
        )
        out.append(piece)
        at += size
        if roundtrip:
            state = json.loads(json.dumps(detok.state()))
            detok = IncrementalDetokenizer.from_state(tokenizer, state, **options)
    out.append(detok.add_tokens(ids[at:]))
    out.append(detok.finish())
    return "".join(out), detok


chunkings = st.lists(st.integers(min_value=0, max_value=4), max_size=40)


@settings(max_examples=150, **FIXTURE_SETTINGS)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=2050), max_size=40), chunks=chunkings, skip=st.booleans()
)
def test_random_ids_equal_decode(tokenizer, ids, chunks, skip):
    """Random IDs include lone UTF-8 continuation bytes and cut characters: the invalid
    bytes become U+FFFD exactly where decode puts them."""
    text, _ = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=80, **FIXTURE_SETTINGS)
@given(text=st.text(max_size=30), chunks=chunkings, skip=st.booleans())
def test_random_text_round_trips(tokenizer, text, chunks, skip):
    ids = tokenizer.encode(text)
    out, _ = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    assert out == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, **FIXTURE_SETTINGS)
@given(text=st.text(alphabet=st.characters(codec="ascii"), max_size=40) | st.sampled_from(SAMPLE_TEXTS))
def test_generic_window_path_equals_decode(metaspace_tokenizer, text):
    ids = metaspace_tokenizer.encode(text)
    for chunks in ([1] * len(ids), [3] * len(ids)):
        out, _ = _stream(metaspace_tokenizer, ids, chunks)
        assert out == metaspace_tokenizer.decode(ids)


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_multibyte_characters_are_never_split(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add_tokens([i]) for i in ids] + [detok.finish()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    if not text.isascii():  # some characters really are split across byte-level tokens
        assert any(p == "" for p in pieces[:-1])


def test_cut_character_at_the_end_becomes_replacement(tokenizer):
    ids = tokenizer.encode("ok 🦜")
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.add_tokens(ids[:-1])
    assert "\ufffd" not in text
    assert text + detok.finish() == tokenizer.decode(ids[:-1])
    assert detok.finish() == "" and detok.add_tokens(ids) == ""  # finished


def _stop_case(tokenizer, text: str, stop: list[str], include: bool = False, step: int = 1):
    ids = tokenizer.encode(text)
    out, detok = _stream(
        tokenizer, ids, [step] * len(ids), stop=stop, include_stop_str_in_output=include, roundtrip=True
    )
    return out, detok


def test_stop_string_split_across_tokens(tokenizer):
    text = "The answer is 42. STOP_HERE and more text"
    out, detok = _stop_case(tokenizer, text, ["STOP_HERE"])
    assert out == "The answer is 42. " and detok.stopped == "STOP_HERE"
    out, _ = _stop_case(tokenizer, text, ["STOP_HERE"], include=True)
    assert out == "The answer is 42. STOP_HERE"
    # earliest match wins, whichever stop string it is
    out, detok = _stop_case(tokenizer, text, ["more", "42"])
    assert out == "The answer is " and detok.stopped == "42"


def test_text_is_held_only_while_a_stop_string_could_match(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["<END>"])
    assert detok.add_tokens(tokenizer.encode("abc <E")) == "abc "
    assert detok.held == "<E"
    assert detok.add_tokens(tokenizer.encode("X")) == "<EX"  # no longer a possible stop
    assert detok.add_tokens(tokenizer.encode(" <EN")) == " "
    assert detok.finish() == "<EN"  # the end of the stream releases it
    assert detok.stopped is None


def test_after_a_stop_nothing_more(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["\n\n"])
    out = detok.add_tokens(tokenizer.encode("line one\n\nline two"))
    assert out == "line one" and detok.stopped == "\n\n"
    assert detok.add_tokens(tokenizer.encode("more")) == "" and detok.finish() == ""
    restored = IncrementalDetokenizer.from_state(tokenizer, detok.state(), stop=["\n\n"])
    assert restored.stopped == "\n\n" and restored.add_tokens([5, 6]) == ""


@settings(max_examples=120, **FIXTURE_SETTINGS)
@given(
    text=st.lists(st.sampled_from(["ab", "c", "é", "🙂", " ", "STOP", "ST", "\n", "xy"]), max_size=20).map(
        "".join
    ),
    stops=st.lists(st.sampled_from(["STOP", "🙂 ", "c\n", "é", "yx", "abc"]), min_size=1, max_size=3),
    include=st.booleans(),
    chunks=chunkings,
)
def test_stop_strings_property(tokenizer, text, stops, include, chunks):
    ids = tokenizer.encode(text)
    out, detok = _stream(tokenizer, ids, chunks, stop=stops, include_stop_str_in_output=include)
    full = tokenizer.decode(ids)
    hits = [(full.find(s), s) for s in stops if s in full]
    if not hits:
        assert out == full and detok.stopped is None
    else:
        at = min(pos for pos, _ in hits)
        # at the earliest position, a shorter stop string can complete first
        candidates = [s for pos, s in hits if pos == at]
        assert detok.stopped in candidates
        assert out == full[: at + (len(detok.stopped) if include else 0)]


def test_state_does_not_grow_with_output(tokenizer):
    text = "Some long output with café and 🙂 emoji, repeated. " * 200
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["NEVER_SEEN_STOP_STRING"])
    sizes, out = [], []
    for i in ids:
        out.append(detok.add_tokens([i]))
        sizes.append(len(json.dumps(detok.state())))
    out.append(detok.finish())
    assert "".join(out) == text
    assert max(sizes) < 120


def test_bad_state_is_rejected(tokenizer):
    for state in ({}, {"v": 1, "held": 3}, {"v": 1, "pending": "zz"}, {"v": 1, "pending": "ffffffffff"}, "x"):
        with pytest.raises(ValueError):
            IncrementalDetokenizer.from_state(tokenizer, state)  # type: ignore[arg-type]
