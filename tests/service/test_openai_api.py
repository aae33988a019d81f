"""The official openai client against the one OpenAI service, run two ways: `serve`
(render → engine → derender in one process) and `up` (the P/D proxy in front of a render
tier, a prefill and a decode engine). Same assertions, same greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import free_port, running_servers

MAX_BODY = 200_000
LIMITS = ["--max-model-len", "512", "--num-blocks", "256", "--max-body-bytes", str(MAX_BODY)]
# `up`: prompts of 16 tokens or more go through the prefill worker and a KV transfer
STACKS = {
    "serve": ["serve", *LIMITS, "--trust-request-chat-template"],
    "up": [
        "up",
        *LIMITS,
        "--trust-request-chat-template",
        "--min-prefill-tokens",
        "16",
        "--pd-decision",
        "threshold",
    ],
}


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def servers(tiny_model) -> Iterator[dict[str, str]]:
    """Both stacks, started side by side: their base URLs by name."""
    ports = {name: free_port() for name in STACKS}
    commands = [
        ([command, tiny_model, "--port", str(ports[name]), *flags], ports[name])
        for name, (command, *flags) in STACKS.items()
    ]
    with running_servers(commands, timeout=180) as bases:
        yield dict(zip(STACKS, bases, strict=True))


@pytest.fixture(scope="module")
def server(servers, stack) -> str:
    return servers[stack]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about the cache."},
]


def test_plain_chat_and_streaming_with_usage(client, model):
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens <= 12 and plain.usage.prompt_tokens > 0
    capped = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0
    )
    assert capped.usage.completion_tokens <= 3
    events = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == choice.message.content  # greedy: streaming and not agree
    assert events[0].choices[0].delta.role == "assistant"
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == choice.finish_reason
    assert events[-1].choices == [] and events[-1].usage.total_tokens == plain.usage.total_tokens
    assert all(e.usage is None for e in events[:-1])


def test_n_seed_and_return_token_ids(client, model):
    def sample(seed: int, n: int = 1):
        return client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"return_token_ids": True},
        )

    first, again, other = sample(42), sample(42), sample(43)
    assert first.choices[0].token_ids == again.choices[0].token_ids
    assert first.choices[0].token_ids != other.choices[0].token_ids
    assert len(first.prompt_token_ids) == first.usage.prompt_tokens
    assert len(first.choices[0].token_ids) == first.usage.completion_tokens
    two = sample(42, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].token_ids == first.choices[0].token_ids  # choice i uses seed + i
    assert two.choices[0].token_ids != two.choices[1].token_ids
    assert two.usage.completion_tokens == sum(len(c.token_ids) for c in two.choices)
    streamed = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    finished = {c.index for e in streamed for c in e.choices if c.finish_reason}
    assert finished == {0, 1}


def test_stop_strings(client, model):
    base = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0)
    text = base.choices[0].message.content
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    expected = text[: text.index(stop)]
    stopped = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].message.content == expected and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < base.usage.completion_tokens
    events = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop, stream=True
    )
    chunks = [c for e in events for c in e.choices]
    assert "".join(c.delta.content or "" for c in chunks) == expected and chunks[-1].finish_reason == "stop"


def test_logprobs(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"skip_special_tokens": False},
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    # greedy: the sampled token is the most likely one
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4) for e in entries)


def test_completions_and_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    completion = client.completions.create(
        model=model, prompt="The cache", max_tokens=5, temperature=0, logprobs=2
    )
    assert completion.object == "text_completion" and completion.usage.completion_tokens <= 5
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens
    batch = client.completions.create(model=model, prompt=["a b", "c d"], max_tokens=3, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    streamed = list(
        client.completions.create(model=model, prompt="The cache", max_tokens=5, temperature=0, stream=True)
    )
    assert "".join(e.choices[0].text for e in streamed if e.choices) == completion.choices[0].text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": []},
        {"messages": [{"role": "user"}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        {"n": 9},
        {"max_tokens": 0},
        {"max_tokens": 100_000},
        {"top_logprobs": 30, "logprobs": True},
        {"extra_body": {"chat_template": "{{ raise_exception('template says no') }}"}},
    ],
)
def test_bad_requests_are_400(client, model, kwargs):
    kwargs = {"messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, **kwargs)
    assert info.value.status_code == 400 and info.value.body["message"]


def test_unknown_model_too_large_body_and_still_serving(client, model, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    huge = [{"role": "user", "content": "x" * (MAX_BODY + 10)}]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=model, messages=huge, max_tokens=4)
    assert info.value.status_code == 413
    raw = httpx.post(
        server + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="session")
def greedy_outputs() -> dict[str, list]:
    """Per stack: the greedy outputs test_greedy_tokens_agree saw."""
    return {}


def test_greedy_tokens_agree(client, model, stack, greedy_outputs):
    """Greedy token IDs, streaming and not, chat and completions; the second stack must
    produce exactly what the first did."""
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    events = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    streamed = [t for e in events for c in e.choices for t in (getattr(c, "token_ids", None) or [])]
    assert streamed == chat.choices[0].token_ids
    completion = client.completions.create(
        model=model, prompt="The cache", max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    outputs = [chat.choices[0].token_ids, chat.choices[0].message.content, completion.choices[0].token_ids]
    for other, expected in greedy_outputs.items():
        assert outputs == expected, f"{stack} and {other} disagree"
    greedy_outputs[stack] = outputs


def test_usage_reports_the_cached_prompt_tokens(client, model):
    """`usage.prompt_tokens_details.cached_tokens`: the prompt tokens not computed for this
    request (OpenAI's and vLLM's field), streaming and not, chat and completions."""
    system = "Cache probe. " + " ".join(f"item{i}" for i in range(60))  # no other test's prefix
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]

    def chat(msgs: list[dict]):
        return client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0)

    first = chat(messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(messages)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens  # the last prompt token is always computed
    events = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=3, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert events[-1].usage.prompt_tokens_details.cached_tokens == cached
    # reuse depends on the tokens, not on the API that carried them
    with_ids = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    by_ids = client.completions.create(
        model=model, prompt=with_ids.prompt_token_ids, max_tokens=1, temperature=0
    )
    assert by_ids.usage.prompt_tokens_details.cached_tokens == cached
    # a new turn: the shared system prompt is reused, the new message (long enough to go
    # through the prefill worker in `up`) is computed
    longer = [*messages, {"role": "user", "content": " ".join(f"more{i}" for i in range(40))}]
    turn = chat(longer)
    assert 0 < turn.usage.prompt_tokens_details.cached_tokens < turn.usage.prompt_tokens - 40
    prompt = "Completion cache probe: " + " ".join(f"entry{i}" for i in range(50))
    completions = [client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)]
    completions.append(client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0))
    assert completions[0].usage.prompt_tokens_details.cached_tokens == 0
    assert completions[1].usage.prompt_tokens_details.cached_tokens > 0


def test_a_stream_carries_every_token_id_once(client, model):
    """Tokens whose text the way back holds (a partial UTF-8 character, a parser's
    lookahead) make no event of their own: their IDs travel with the next one, so a
    stream's IDs are the non-streaming answer's, as many as usage counts."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, temperature=0, extra_body=extra
    )
    events = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=200,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    streamed = [t for e in events for c in e.choices for t in (getattr(c, "token_ids", None) or [])]
    assert streamed == whole.choices[0].token_ids
    assert len(streamed) == events[-1].usage.completion_tokens == 200
    text_events = client.completions.create(
        model=model, prompt="The cache", max_tokens=200, temperature=0, stream=True, extra_body=extra
    )
    text_ids = [t for e in text_events for c in e.choices for t in (getattr(c, "token_ids", None) or [])]
    assert len(text_ids) == 200


# phases a request's timeline has on each stack (protocol/timeline.py); `up` pushes
# prompts of 16 tokens or more through the prefill worker, which starts computing with
# decode's request: decode's reservation follows it, so no `reserve` wait comes first
SERVE_PHASES = {"render", "prefill_queue", "prefill", "hops", "decode", "derender", "send"}
TIMELINE_PHASES = {
    "serve": SERVE_PHASES,
    "up": SERVE_PHASES | {"route", "handoff", "decode_first_step"},
}


def test_timeline_on_request(client, model, stack, server):
    """`x-splitserve-timeline: 1` gets the request's phases in the final chunk (streaming)
    or the response (not): each non-negative, together within the client's wall time.
    Without the header nothing changes; the proxy's /metrics has each phase's histogram."""
    import time

    header = {"x-splitserve-timeline": "1"}

    def probe(name: str) -> list[dict]:
        # a prompt of its own from its first block: no prefix hit on decode keeps it off
        # prefill, nor (bidirectional) makes prefill wait for decode's prefix offer
        return [
            {
                "role": "user",
                "content": f"{name} timeline probe: " + " ".join(f"{name}{i}" for i in range(20)),
            }
        ]

    def check(timeline: dict, wall_s: float) -> None:
        assert set(timeline) == TIMELINE_PHASES[stack]
        assert all(isinstance(v, float) and v >= 0 for v in timeline.values())
        assert 0 < sum(timeline.values()) <= wall_s
        assert timeline["prefill"] > 0

    started = time.monotonic()
    plain = client.chat.completions.create(
        model=model, messages=probe("plain"), max_tokens=6, temperature=0, extra_headers=header
    )
    check(plain.model_extra["splitserve_timeline"], time.monotonic() - started)
    started = time.monotonic()
    events = list(
        client.chat.completions.create(
            model=model, messages=probe("stream"), max_tokens=6, stream=True, extra_headers=header
        )
    )
    wall_s = time.monotonic() - started
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] is not None
    assert events[-1].choices == [] and all("splitserve_timeline" not in e.model_extra for e in events[:-1])
    check(events[-1].model_extra["splitserve_timeline"], wall_s)
    with_usage = list(
        client.completions.create(
            model=model, prompt=probe("completion")[0]["content"], max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_headers=header,
        )
    )  # fmt: skip
    assert with_usage[-1].usage.completion_tokens == 4  # the usage chunk carries it
    assert set(with_usage[-1].model_extra["splitserve_timeline"]) == TIMELINE_PHASES[stack]
    unasked = client.chat.completions.create(model=model, messages=probe("unasked"), max_tokens=2)
    assert "splitserve_timeline" not in (unasked.model_extra or {})
    if stack == "up":
        text = httpx.get(server + "/metrics", timeout=10).text
        for phase in TIMELINE_PHASES["up"]:
            assert f'splitserve_proxy_request_phase_seconds_count{{phase="{phase}"}}' in text
        assert "splitserve_proxy_derender_call_seconds_count" in text
