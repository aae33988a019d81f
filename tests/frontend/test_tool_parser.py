"""Hermes tool-call parser: streamed deltas equal the non-streamed result, at every split."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.frontend.reasoning_parser import ReasoningParser
from splitserve.frontend.tool_parser import (
    ContentDelta,
    HermesToolParser,
    ToolCall,
    ToolCallDelta,
    parse_tool_calls,
    tool_call_id,
)

SALT = "req-123"
TRICKY_ARGS = (
    '{"text": "a literal </tool_call> and <tool_call> inside", "q": "\\"}\\\\", "n": [1, {"x": []}]}'
)
CASES = [
    # (text, content, [(name, arguments)])
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        f'Let me look.\n\n<tool_call>\n{{"name": "write", "arguments": {TRICKY_ARGS}}}\n</tool_call>',
        "Let me look.",
        [("write", TRICKY_ARGS)],
    ),
    (
        'Two calls:\n<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"k": "東京 🙂"}}\n</tool_call>\nThen text after.\n',
        "Two calls:\nThen text after.\n",
        [("a", '{"k": 1}'), ("b", '{"k": "東京 🙂"}')],
    ),
    (
        '<tool_call>{"arguments": {"late": "name"}, "name": "late_name"}</tool_call>',
        None,
        [("late_name", '{"late": "name"}')],
    ),
    ('<tool_call>{"name": "no_args"}</tool_call>', None, [("no_args", "{}")]),
    (
        '<tool_call>{"name": "extra", "arguments":{"a":[1,2]},"id":"x\\"}"}</tool_call>',
        None,
        [("extra", '{"a":[1,2]}')],
    ),
    ('<tool_call>{"name": "n", "arguments": null}</tool_call>', None, [("n", "null")]),
    ('<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("s", '"{\\"a\\": 1}"')]),
    ('<tool_call>{"name": "esc\\u00e9\\"q"}</tool_call>', None, [('escé"q', "{}")]),
    # cut short by the token limit after the arguments began: the call stays, cut short
    ('Sure <tool_call>{"name": "f", "arguments": {"a": "unfinish', "Sure", [("f", '{"a": "unfinish')]),
    # no closing tag after a complete object: the call counts, what follows is content
    ('<tool_call>{"name": "f", "arguments": {}} trailing', "trailing", [("f", "{}")]),
    ('<tool_call>{"name": "f"}<tool_call>{"name": "g"}', None, [("f", "{}"), ("g", "{}")]),
    # malformed: the raw text is content
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('x <tool_call>{"name": 3}</tool_call>', 'x <tool_call>{"name": 3}</tool_call>', []),
    ('x\n<tool_call>{"name": "f"', 'x\n<tool_call>{"name": "f"', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name" "f"}</tool_call>', '<tool_call>{"name" "f"}</tool_call>', []),
    (
        "plain text with <tool and </tool_call> but no call",
        "plain text with <tool and </tool_call> but no call",
        [],
    ),
    ("answer with trailing newline\n", "answer with trailing newline\n", []),
    ("", None, []),
]


def _stream(text: str, cuts: list[int], roundtrip: bool, salt: str = SALT) -> list:
    parser = HermesToolParser(id_salt=salt)
    deltas: list = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for a, b in itertools.pairwise(bounds):
        deltas += parser.feed(text[a:b])
        if roundtrip:
            parser = HermesToolParser.from_state(json.loads(json.dumps(parser.state())))
    return deltas + parser.finish()


def _join(deltas: list) -> tuple[str | None, list[ToolCall]]:
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index not in calls:
                assert d.id is not None and d.name is not None  # id and name come first
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [ToolCall(*calls[i]) for i in sorted(calls)]


def _expected(case) -> tuple[str | None, list[ToolCall]]:
    _, content, calls = case
    return content, [ToolCall(tool_call_id(SALT, i), name, args) for i, (name, args) in enumerate(calls)]


@pytest.mark.parametrize("case", CASES, ids=[c[0][:40] for c in CASES])
def test_known_texts(case):
    text = case[0]
    assert parse_tool_calls(text, id_salt=SALT) == _expected(case)
    assert _join(_stream(text, list(range(len(text))), roundtrip=True)) == _expected(case)


@settings(max_examples=400, deadline=None)
@given(
    case=st.sampled_from(CASES),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=16),
    roundtrip=st.booleans(),
)
def test_every_split_of_known_texts(case, cuts, roundtrip):
    assert _join(_stream(case[0], cuts, roundtrip)) == _expected(case)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(
        alphabet=st.sampled_from(['"', "\\", "<", "/", ">", "}", "{", "a", "é", "🙂", "\n"]), max_size=12
    )
    | st.just("</tool_call>"),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
separators = st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")])


@settings(max_examples=300, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=6), json_values, max_size=4)
        ),
        max_size=3,
    ),
    before=st.sampled_from(["", "Sure.", "Let me check </tool_call> this.\n\n"]),
    after=st.sampled_from(["", "\n", "\nDone."]),
    seps=separators,
    ensure_ascii=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=20),
)
def test_generated_calls(calls, before, after, seps, ensure_ascii, cuts):
    """Arguments come back exactly as written (any spacing, escapes, a literal </tool_call>
    in a string), and streaming with a state round trip at random splits agrees."""
    written = [json.dumps(args, separators=seps, ensure_ascii=ensure_ascii) for _, args in calls]
    body = "\n".join(
        f'<tool_call>\n{{{json.dumps("name")}: {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'
        for (name, _), args in zip(calls, written, strict=True)
    )
    text = before + ("\n" if before and body else "") + body + after
    content, parsed = parse_tool_calls(text, id_salt=SALT)
    assert [(c.name, c.arguments) for c in parsed] == [
        (n, w) for (n, _), w in zip(calls, written, strict=True)
    ]
    assert [json.loads(c.arguments) for c in parsed] == [args for _, args in calls]
    # whitespace next to calls is not content; all other text is, verbatim
    expected = before.rstrip() + (after if after.strip() else "") if calls else text
    assert content == (expected or None)
    assert _join(_stream(text, cuts, roundtrip=True)) == (content, parsed)


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(
            [
                "<tool_call>",
                "</tool_call>",
                "<tool",
                "</tool",
                '{"name": "f"',
                ', "arguments": ',
                "{",
                "}",
                '"',
                "\\",
                "[",
                "]",
                "x",
                " ",
                "\n",
                "é",
            ]
        ),
        max_size=20,
    ).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=12),
)
def test_random_fragments_stream_like_non_streamed(text, cuts):
    """Any text at all, malformed included: streaming at random splits equals one feed."""
    assert _join(_stream(text, cuts, roundtrip=True)) == parse_tool_calls(text, id_salt=SALT)


def test_first_delta_carries_id_and_name_then_arguments_stream():
    parser = HermesToolParser(id_salt=SALT)
    assert parser.feed("Checking.\n<tool_") == [ContentDelta("Checking.")]
    assert parser.feed('call>\n{"name": "get_') == []
    assert parser.feed('weather", "arguments": {"ci') == [
        ToolCallDelta(0, tool_call_id(SALT, 0), "get_weather", '{"ci')
    ]
    assert parser.feed('ty": "Paris"}}\n</tool_call>') == [ToolCallDelta(0, None, None, 'ty": "Paris"}')]
    assert parser.finish() == []


def test_reasoning_then_tool_call():
    """The composition the derender layer uses: the reasoning parser's content feeds the tool parser."""
    text = (
        "<think>\nThe user wants weather; maybe <tool_call> is needed.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for step in (1, 3, 7, len(text)):
        reasoning_parser = ReasoningParser(starts_in_reasoning=False)
        tools = HermesToolParser(id_salt=SALT)
        reasoning, deltas = "", []
        for at in range(0, len(text), step):
            for d in reasoning_parser.feed(text[at : at + step]):
                if d.kind == "reasoning":
                    reasoning += d.text
                else:
                    deltas += tools.feed(d.text)
        for d in reasoning_parser.finish():
            deltas += tools.feed(d.text)
        deltas += tools.finish()
        assert reasoning == "The user wants weather; maybe <tool_call> is needed."
        assert _join(deltas) == (None, [ToolCall(tool_call_id(SALT, 0), "get_weather", '{"city": "Paris"}')])


def test_ids_are_deterministic_per_salt_and_index():
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    _, first = parse_tool_calls(text, id_salt="r1")
    _, again = parse_tool_calls(text, id_salt="r1")
    _, other = parse_tool_calls(text, id_salt="r2")
    assert first == again
    assert first[0].id != first[1].id and first[0].id != other[0].id
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in first + other)


def _feed_times(text: str, windows: int) -> list[float]:
    parser = HermesToolParser()
    size = len(text) // windows
    times = []
    for w in range(windows):
        start = time.perf_counter()
        for ch in text[w * size : (w + 1) * size]:
            parser.feed(ch)
        times.append(time.perf_counter() - start)
    return times


def test_work_per_feed_does_not_grow_with_output():
    """A long tool call fed one character per call: the 10th stretch costs what the 1st did,
    and the state never holds the argument text already sent."""
    args = json.dumps({"code": 'print("</tool_call>")\n\\ {[ ' * 800, "list": list(range(500))})
    text = 'Some content first. <tool_call>{"name": "run", "arguments": ' + args + "}</tool_call>"
    text = text[: len(text) // 10 * 10]
    best = [min(ts) for ts in zip(*(_feed_times(text, 10) for _ in range(3)), strict=True)]
    assert best[-1] < 3 * best[0] + 0.005, best
    parser = HermesToolParser(id_salt=SALT)
    sent = ""
    for ch in text:
        for d in parser.feed(ch):
            sent += d.arguments if isinstance(d, ToolCallDelta) else ""
        assert len(json.dumps(parser.state())) < 400
    assert sent == args
    assert parser.chars_examined <= 2 * len(text)


@pytest.mark.parametrize(
    "state",
    [
        None,
        {},
        {"id_salt": "", "index": 0, "mode": "content", "ws": "", "tag": "<tool_call>", "after_call": False},
        {"id_salt": "", "index": -1, "mode": "content", "ws": "", "tag": "", "after_call": False},
        {"id_salt": "", "index": 0, "mode": "call", "ws": "", "tag": "", "after_call": False},
        {"id_salt": 5, "index": 0, "mode": "content", "ws": "", "tag": "", "after_call": False},
        {
            "id_salt": "",
            "index": 0,
            "mode": "content",
            "ws": "not whitespace",
            "tag": "",
            "after_call": False,
        },
        {"id_salt": "", "index": 0, "mode": "call", "raw": "", "call": {}},
        {"id_salt": "", "index": 0, "mode": "close", "close_matched": 99},
        {"id_salt": "", "index": 0, "mode": "elsewhere", "close_matched": 0},
    ],
)
def test_bad_state_is_rejected(state):
    with pytest.raises(ValueError):
        HermesToolParser.from_state(state)  # type: ignore[arg-type]
