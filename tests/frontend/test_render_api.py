"""`splitserve render`: render and derender over HTTP; streaming derender across replicas."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from splitserve.frontend.tokenizer import Tokenizer
from tests.conftest import free_port, running_servers

KEY = "shared-test-key-0123"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OUTPUT = (
    "<think>\nNeed the weather for Paris.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "note": "x </tool_call> y"}}\n</tool_call>'
)
CHAT = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 64}


@pytest.fixture(scope="module")
def servers(tiny_model):
    ports = [free_port() for _ in range(3)]
    keys = [KEY, KEY, "a-different-key-999"]
    flags = ["--max-body-bytes", "100000"]
    renders = [
        (["render", tiny_model, "--port", str(port), "--state-key", key, *flags], port)
        for port, key in zip(ports, keys, strict=True)
    ]
    with running_servers(renders) as bases:
        yield bases


@pytest.fixture(scope="module")
def output_ids(tiny_model) -> list[int]:
    return Tokenizer.from_dir(tiny_model).encode(OUTPUT)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30)


def test_render_endpoints(servers):
    base = servers[0]
    rendered = post(base, "/v1/chat/completions/render", CHAT)
    assert rendered.status_code == 200
    generate = rendered.json()
    assert generate["token_ids"] and generate["sampling_params"]["max_tokens"] == 64
    assert len(generate["block_hashes"]) == len(generate["token_ids"]) // 16 and generate["features"] is None
    # every replica renders the same IDs and hashes
    again = post(servers[1], "/v1/chat/completions/render", CHAT).json()
    assert (again["token_ids"], again["block_hashes"]) == (generate["token_ids"], generate["block_hashes"])
    completions = post(base, "/v1/completions/render", {"prompt": [[4, 5], [1, 2, 3]], "max_tokens": 4})
    assert completions.status_code == 200 and [g["token_ids"] for g in completions.json()] == [
        [4, 5],
        [1, 2, 3],
    ]
    text = post(base, "/v1/completions/render", {"prompt": "hello"}).json()
    assert len(text) == 1 and text[0]["sampling_params"]["max_tokens"] == 16  # the OpenAI default
    models = httpx.get(base + "/v1/models").json()["data"]
    assert len(models) == 1 and models[0]["max_model_len"] > 0


def test_non_streaming_derender_parses_reasoning_and_tools(servers, output_ids):
    body = {
        "generate_response": {
            "request_id": "r1",
            "choices": [{"index": 0, "token_ids": output_ids, "finish_reason": "stop"}],
        },
        "chat_request": CHAT,
    }
    response = post(servers[0], "/v1/chat/completions/derender", body)
    assert response.status_code == 200
    completion = ChatCompletion.model_validate(response.json())  # the openai client's own type
    message = completion.choices[0].message
    assert message.reasoning == "Need the weather for Paris."
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "note": "x </tool_call> y"}


def stream_through(bases: list[str], ids: list[int], request_id: str = "s1") -> tuple[list[dict], list[str]]:
    """One token per call, the i-th call to bases[i % len(bases)]."""
    state, chunks, states = None, [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        body = {
            "stream": True,
            "generate_chunk": {
                "request_id": request_id,
                "choices": [{"index": 0, "token_ids": [token], "finish_reason": "stop" if last else None}],
            },
            "stream_state": state,
            "chat_request": {**CHAT, "stream": True},
        }
        response = post(bases[i % len(bases)], "/v1/chat/completions/derender", body)
        assert response.status_code == 200, response.text
        state = response.json()["stream_state"]
        chunks.append(response.json()["chunk"])
        states.append(state)
    return chunks, states


def test_streaming_derender_is_stateless_across_replicas(servers, output_ids):
    one, _ = stream_through(servers[:1], output_ids)
    two, _ = stream_through(servers[:2], output_ids)
    strip = [[{k: v for k, v in c.items() if k != "created"} for c in chunks] for chunks in (one, two)]
    assert strip[0] == strip[1]
    parsed = [ChatCompletionChunk.model_validate(c) for c in two]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in parsed if c.choices)
    arguments = "".join(
        (call.function.arguments or "")
        for c in parsed
        if c.choices
        for call in c.choices[0].delta.tool_calls or []
    )
    assert reasoning == "Need the weather for Paris."
    assert json.loads(arguments) == {"city": "Paris", "note": "x </tool_call> y"}
    assert parsed[-1].choices[0].finish_reason == "tool_calls"


def test_tampered_or_foreign_state_is_refused(servers, output_ids):
    _, states = stream_through(servers[:1], output_ids[:5])
    state = states[-1]
    version, payload, mac = state.split(".")
    tampered = f"{version}.{payload[:-1] + ('A' if payload[-1] != 'A' else 'B')}.{mac}"
    body = {
        "stream": True,
        "generate_chunk": {"request_id": "s1", "choices": [{"index": 0, "token_ids": [output_ids[5]]}]},
        "chat_request": CHAT,
    }
    for bad_state, base in ((tampered, servers[0]), (state, servers[2]), ("not-a-state", servers[1])):
        response = post(base, "/v1/chat/completions/derender", {**body, "stream_state": bad_state})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_state"
    assert (
        post(servers[1], "/v1/chat/completions/derender", {**body, "stream_state": state}).status_code == 200
    )


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions/render", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}], "n": 9}, 400),
        (
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
            404,
        ),
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x" * 200_000}]}, 413),
        (
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            400,
        ),
        ("/v1/completions/render", {"prompt": [10**9]}, 400),
        (
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            400,
        ),
        ("/v1/chat/completions/derender", {"generate_response": {"choices": [{"token_ids": [10**9]}]}}, 400),
        ("/v1/chat/completions/derender", {"generate_response": {"choices": [{"token_ids": [-1]}]}}, 400),
        ("/v1/chat/completions/derender", {"stream": True, "generate_chunk": {"choices": "x"}}, 400),
        ("/v1/chat/completions/derender", {"stream": True}, 400),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": {
                    "choices": [{"token_ids": [1], "logprobs": {"content": [{"logprob": 0}]}}]
                }
            },
            400,
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": {
                    "choices": [
                        {
                            "token_ids": [1],
                            "logprobs": {
                                "content": [
                                    {
                                        "token_id": 1,
                                        "logprob": -1,
                                        "top_logprobs": [{"token_id": 10**9, "logprob": -2}],
                                    }
                                ]
                            },
                        }
                    ]
                }
            },
            400,
        ),
    ],
)
def test_bad_requests(servers, path, body, status):
    response = post(servers[0], path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def test_cli_refuses_a_short_state_key(tiny_model, capsys):
    from splitserve.cli import main

    assert main(["render", tiny_model, "--state-key", "short"]) == 2
    assert "at least 8 bytes" in capsys.readouterr().err


def derender_pieces(bases: list[str], state: str, ids: list[int]) -> tuple[list[dict], list[int]]:
    """The proxy's way back: one token per call, the i-th call to bases[i % len(bases)];
    the answers and the request bytes of each call."""
    answers, sizes = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        reason = "stop" if last else None
        piece = {"state": state, "token_ids": [token], "finish_reason": reason, "final": last}
        body = json.dumps({"pieces": [piece]})
        sizes.append(len(body))
        response = httpx.post(
            bases[i % len(bases)] + "/v1/derender/pieces",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        (answer,) = response.json()["pieces"]
        state = answer["state"]
        answers.append(answer)
    return answers, sizes


def render_with_state(base: str, chat: dict) -> tuple[dict, str]:
    response = httpx.post(base + "/v1/chat/completions/render?derender_state=true", json=chat, timeout=30)
    assert response.status_code == 200, response.text
    generate = response.json()
    return generate, generate.pop("derender_state")


def test_derender_pieces_carry_new_tokens_and_a_signed_state_only(servers, output_ids):
    generate, state = render_with_state(servers[0], CHAT)
    plain = post(servers[0], "/v1/chat/completions/render", CHAT).json()
    assert {k: v for k, v in generate.items() if k != "request_id"} == {
        k: v for k, v in plain.items() if k != "request_id"
    }
    answers, sizes = derender_pieces(servers[:2], state, output_ids)
    deltas = [a["delta"] for a in answers]
    reasoning = "".join(d["reasoning"] for d in deltas)
    arguments = "".join(call["arguments"] for d in deltas for call in d["tool_calls"])
    assert reasoning == "Need the weather for Paris."
    assert json.loads(arguments) == {"city": "Paris", "note": "x </tool_call> y"}
    assert answers[-1]["finish_reason"] == "tool_calls" and not any(a["stopped"] for a in answers)
    assert sum(d["num_tokens"] for d in deltas) == len(output_ids)
    # the conversation never travels again: a 40-turn chat costs what a 1-turn chat does
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 5} for i in range(79)]
    _, long_state = render_with_state(servers[0], {**CHAT, "messages": turns, "max_tokens": 8})
    _, long_sizes = derender_pieces(servers[:1], long_state, output_ids[:8])
    assert max(long_sizes) <= max(sizes[:8]) + 16
    # one call, one piece per engine chunk: later pieces continue the first (state null)
    pieces = [{"state": state if i == 0 else None, "token_ids": [t]} for i, t in enumerate(output_ids)]
    pieces[-1] = {**pieces[-1], "finish_reason": "stop", "final": True}
    together = post(servers[1], "/v1/derender/pieces", {"pieces": pieces}).json()["pieces"]
    assert [a["delta"] for a in together] == deltas
    assert [a["state"] is None for a in together] == [True] * (len(pieces) - 1) + [False]
    first_null = post(servers[0], "/v1/derender/pieces", {"pieces": [{"state": None, "token_ids": [1]}]})
    assert first_null.status_code == 400 and first_null.json()["error"]["param"] == "pieces[0].state"
    # a state signed with another key, or forged, is refused naming it
    for bad in (state, "s1.x.y"):
        response = post(servers[2], "/v1/derender/pieces", {"pieces": [{"state": bad, "token_ids": [1]}]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "pieces[0].state"


def test_a_derender_of_more_pieces_than_one_call_takes_is_split(servers, tiny_model):
    """A resumed stream can bring more engine chunks at once than one call may carry (1,024
    pieces): the HTTP client sends them as consecutive calls, each continuing the last."""
    import asyncio

    from splitserve.protocol.derender_api import MAX_PIECES
    from splitserve.protocol.frontend_client import DerenderPiece
    from splitserve.runtime.http_frontend_client import HTTPFrontendClient

    token_ids = Tokenizer.from_dir(tiny_model).encode("hello world, how are you today? " * 300)[:1500]
    assert len(token_ids) == 1500 > MAX_PIECES
    _, state = render_with_state(servers[0], {**CHAT, "tools": None, "max_tokens": 1500})

    def pieces(first_state: str, ids: list[int], last: bool) -> list[DerenderPiece]:
        run = [
            DerenderPiece(first_state if i == 0 else None, 0, [token], None, None, False)
            for i, token in enumerate(ids)
        ]
        run[-1] = run[-1]._replace(finish_reason="length" if last else None, final=last)
        return run

    async def run() -> tuple[list, list]:
        client = HTTPFrontendClient(servers[0])
        try:
            whole = await client.derender(pieces(state, token_ids, True))
            head = await client.derender(pieces(state, token_ids[:700], False))
            tail = await client.derender(pieces(head[-1].state, token_ids[700:], True))
            return whole, head + tail
        finally:
            await client.close()

    whole, in_two = asyncio.run(run())
    assert [p.delta for p in whole] == [p.delta for p in in_two]
    assert sum(p.delta.num_tokens for p in whole) == 1500 and whole[-1].finish_reason == "length"
