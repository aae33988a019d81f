"""Reasoning parser: streamed deltas equal the non-streamed result, at every split."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.frontend.reasoning_parser import Delta, ReasoningParser, parse_reasoning

CASES = [
    # (text, starts_in_reasoning, reasoning, content)
    ("<think>\nNeed the tool.\n</think>\n\nThe answer.", False, "Need the tool.", "The answer."),
    ("<think>a</think>b", False, "a", "b"),
    ("<think>\n\n</think>\n\nquick", False, None, "quick"),  # enable_thinking false, as the model echoes it
    ("plain answer, no thinking", False, None, "plain answer, no thinking"),
    ("no <think> at the start</think>", False, None, "no <think> at the start</think>"),
    ("already thinking\n</think>\n\nanswer", True, "already thinking", "answer"),
    ("thinking cut short <", True, "thinking cut short <", ""),
    (
        "<think>\nline 1\n\nline 2 </thinking> </thin\n</think>",
        False,
        "line 1\n\nline 2 </thinking> </thin",
        "",
    ),
    ("<think>x</think>y</think>z", False, "x", "y</think>z"),
    ("<thi", False, None, "<thi"),
    ("", False, None, ""),
    ("", True, None, ""),
    (
        "<think>\n🙂 é 東京\n</think>\n\n<tool_call>\n{}\n</tool_call>",
        False,
        "🙂 é 東京",
        "<tool_call>\n{}\n</tool_call>",
    ),
]


def _stream(text: str, starts: bool, cuts: list[int], roundtrip: bool) -> list[Delta]:
    parser = ReasoningParser(starts_in_reasoning=starts)
    deltas: list[Delta] = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for a, b in itertools.pairwise(bounds):
        deltas += parser.feed(text[a:b])
        if roundtrip:
            parser = ReasoningParser.from_state(json.loads(json.dumps(parser.state())))
    return deltas + parser.finish()


def _join(deltas: list[Delta]) -> tuple[str | None, str]:
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    return reasoning or None, "".join(d.text for d in deltas if d.kind == "content")


@pytest.mark.parametrize("text, starts, reasoning, content", CASES)
def test_known_texts(text, starts, reasoning, content):
    assert parse_reasoning(text, starts) == (reasoning, content)
    # one character at a time, with a state round trip at every step
    assert _join(_stream(text, starts, list(range(len(text))), roundtrip=True)) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from(CASES),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=12),
    roundtrip=st.booleans(),
)
def test_every_split_of_known_texts(case, cuts, roundtrip):
    text, starts, reasoning, content = case
    assert _join(_stream(text, starts, cuts, roundtrip)) == (reasoning, content)


pieces = st.sampled_from(
    ["<think>", "</think>", "<", "</", "<thi", "</thin", "k>", "\n", "\n\n", "a", "é🙂", " "]
)


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(pieces, max_size=16).map("".join),
    starts=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10),
)
def test_random_texts_stream_like_non_streamed(text, starts, cuts):
    streamed = _stream(text, starts, cuts, roundtrip=True)
    assert _join(streamed) == parse_reasoning(text, starts)
    assert all(d.text for d in streamed)  # no empty deltas
    # deltas of one feed are merged per kind: no two neighbours of the same kind
    single = ReasoningParser(starts_in_reasoning=starts).feed(text)
    assert all(a.kind != b.kind for a, b in itertools.pairwise(single))


def test_deltas_are_streamed_not_buffered():
    parser = ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nstep one") == [Delta("reasoning", "step one")]
    assert parser.feed("\n</th") == []  # a newline that may precede </think> and a tag prefix
    assert parser.feed("ought") == [Delta("reasoning", "\n</thought")]
    assert parser.feed("</think>\n\nHi") == [Delta("content", "Hi")]
    assert parser.finish() == []


def _feed_times(text: str, windows: int) -> list[float]:
    """Seconds to feed each tenth of `text`, one character per call."""
    parser = ReasoningParser(starts_in_reasoning=True)
    size = len(text) // windows
    times = []
    for w in range(windows):
        start = time.perf_counter()
        for ch in text[w * size : (w + 1) * size]:
            parser.feed(ch)
        times.append(time.perf_counter() - start)
    return times


def test_work_per_feed_does_not_grow_with_output():
    """No rescans: feeding the 10th stretch of a long output costs what the 1st did, and the
    characters examined stay proportional to the input (a rescan would be quadratic)."""
    text = ("thinking about < and </thin and\n\n newlines " * 1000)[:40000]
    best = [min(ts) for ts in zip(*(_feed_times(text, 10) for _ in range(3)), strict=True)]
    assert best[-1] < 3 * best[0] + 0.005, best
    parser = ReasoningParser(starts_in_reasoning=True)
    for ch in text:
        parser.feed(ch)
        assert len(json.dumps(parser.state())) < 100
    assert parser.chars_examined <= 2 * len(text)


@pytest.mark.parametrize(
    "state",
    [
        None,
        {},
        {"mode": "elsewhere", "held": "", "newlines": 0, "strip": False},
        {"mode": "reasoning", "held": "</think>", "newlines": 0, "strip": False},
        {"mode": "reasoning", "held": "", "newlines": -1, "strip": False},
        {"mode": "content", "held": "", "newlines": 0, "strip": 1},
    ],
)
def test_bad_state_is_rejected(state):
    with pytest.raises(ValueError):
        ReasoningParser.from_state(state)  # type: ignore[arg-type]
