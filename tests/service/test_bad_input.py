"""Bad input stays the sender's problem, against real processes (`serve` and `up`): the
fuzz cases of issue 15 each get a 4xx naming what is wrong, and a seeded random fuzzer
over every endpoint of both stacks, bounded in time, sees 0 5xx, 0 dead parts, and a
well-formed greedy stream running alongside it is unchanged."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, running_servers

FLAGS = ["--max-model-len", "512", "--num-blocks", "256"]
FUZZ_SECONDS_PER_ENDPOINT = 1.0
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hello", "max_tokens": 2}
GENERATE = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}}
PIECES = {"pieces": [{"state": None, "index": 0, "token_ids": [1, 2]}]}
DERENDER = {
    "generate_response": {"choices": [{"index": 0, "token_ids": [1, 2], "finish_reason": "stop"}]},
    "chat_request": CHAT,
}
KV_ID = {"request_id": "fuzz", "timeout_s": 0}
# up's internal parts want the deployment's token; the fuzzer is the deployment's own client
INTERNAL_TOKEN = "bad-input-test-token"
HEADERS = {"content-type": "application/json", "Authorization": f"Bearer {INTERNAL_TOKEN}"}


@pytest.fixture(scope="module")
def servers(tiny_model) -> Iterator[tuple[dict[str, str], str]]:
    """`up` (the parts by name: their base URLs, proxy included) and `serve`, started side
    by side (the deployment's token in both environments: `serve` has no internal API)."""
    up_port, serve_port = free_port(), free_port()
    up_args = ["up", tiny_model, "--port", str(up_port), "--min-prefill-tokens", "16"]
    up_args += ["--pd-decision", "threshold", *FLAGS]
    serve_args = ["serve", tiny_model, "--port", str(serve_port), *FLAGS]
    with running_servers(
        [(up_args, up_port), (serve_args, serve_port)],
        timeout=180,
        env={"SPLITSERVE_INTERNAL_TOKEN": INTERNAL_TOKEN},
    ) as (base, serve):
        log = Path(f"/tmp/splitserve-test-{up_port}.log")
        deadline = time.monotonic() + 30
        while "OpenAI API:" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        parts = dict(re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid \d+\)", log.read_text(), re.M))
        yield parts | {"proxy": base}, serve


@pytest.fixture(scope="module")
def up(servers: tuple[dict[str, str], str]) -> dict[str, str]:
    return servers[0]


@pytest.fixture(scope="module")
def serve(servers: tuple[dict[str, str], str]) -> str:
    return servers[1]


def raw_post(url: str, body: str | bytes) -> httpx.Response:
    return httpx.post(url, content=body, headers=HEADERS, timeout=60)


def chat_with(extra: str) -> str:
    return '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2' + extra + "}"


ISSUE_CASES = {  # name: (part, path, raw body, the param or message fragment the 400 names)
    "nan": ("proxy", "/v1/chat/completions", chat_with(',"temperature":NaN'), "NaN"),
    "infinity": ("proxy", "/v1/chat/completions", chat_with(',"top_p":-Infinity'), "Infinity"),
    "1e999": ("proxy", "/v1/chat/completions", chat_with(',"top_p":1e999'), "out of range"),
    "surrogate": ("proxy", "/v1/chat/completions", chat_with(',"user":"\\ud800"'), "surrogate"),
    "deep": ("proxy", "/v1/chat/completions", "[" * 100_000, "nests deeper"),
    "bigint": ("proxy", "/v1/completions", chat_with(',"seed":' + "9" * 5000), "integer of 5000"),
    "derender usage": (
        "render",
        "/v1/chat/completions/derender",
        json.dumps({**DERENDER, "generate_response": {"choices": [], "usage": {"prompt_tokens": [1]}}}),
        "generate_response.usage.prompt_tokens",
    ),
    "derender nan logprob": (
        "render",
        "/v1/chat/completions/derender",
        '{"generate_response":{"choices":[{"token_ids":[1],"logprobs":{"content":'
        '[{"token_id":1,"logprob":NaN}]}}]},"chat_request":{"messages":[]}}',
        "NaN",
    ),
    "transfer_failed surrogate": (
        "decode-0",
        "/inference/v1/kv/transfer_failed",
        '{"request_id":"\\ud800"}',
        "surrogate",
    ),
    "transfer_mode bogus": (
        "decode-0",
        "/inference/v1/generate",
        json.dumps({**GENERATE, "kv_transfer_params": {"do_remote_prefill": True, "transfer_mode": "bogus"}}),
        "kv_transfer_params.transfer_mode",
    ),
    "remote_block_ids string": (
        "prefill-0",
        "/inference/v1/generate",
        json.dumps({**GENERATE, "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": "x"}}),
        "kv_transfer_params.remote_block_ids",
    ),
    "remote_port out of range": (
        "decode-0",
        "/inference/v1/generate",
        json.dumps({**GENERATE, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 70000}}),
        "kv_transfer_params.remote_port",
    ),
    "10 MB chat": (
        "proxy",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "a" * 10_000_000}], "max_tokens": 2}),
        "characters",
    ),
}


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_each_fuzz_case_of_the_issue_is_a_400_naming_what_is_wrong(up, case):
    part, path, body, named = ISSUE_CASES[case]
    response = raw_post(up[part] + path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] or named == error["param"], error


def test_a_body_past_the_limit_is_refused_before_parsing(up):
    response = raw_post(up["proxy"] + "/v1/chat/completions", b"[" * (33 * 1024 * 1024))
    assert response.status_code == 413, response.text


# --- the seeded random fuzzer ---

ODD_VALUES: list[object] = [
    None, True, -1, 0, 2**64, 1.5, 1e308, -1e308, "", "x" * 300, "\u2028", [], [[[]]], {}, {"a": None},
    [-5, 2**40], "NaN",
]  # fmt: skip
ODD_RAW = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    '"\\ud800"',
    '"\\udfff x"',
    "9" * 400,
    "[" * 200 + "]" * 200,
]


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


def _replaced(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    target = copy
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return copy


MARK = "__odd_raw__"


def mutations(base: dict, rng: random.Random) -> Iterator[bytes]:
    """Endless bodies: one field of `base` replaced by an odd value, an odd raw literal
    spliced in where a value goes, a new odd field, or bytes cut and flipped."""
    paths = _paths(base)
    while True:
        kind = rng.random()
        path = rng.choice(paths)
        if kind < 0.4:
            yield json.dumps(_replaced(base, path, rng.choice(ODD_VALUES))).encode()
        elif kind < 0.7:
            text = json.dumps(_replaced(base, path, MARK))
            yield text.replace(f'"{MARK}"', rng.choice(ODD_RAW)).encode()
        elif kind < 0.85 and isinstance(base, dict):
            yield json.dumps(
                {**base, rng.choice(["extra", "stream", "n", "logprobs"]): rng.choice(ODD_VALUES)}
            ).encode()
        else:
            data = bytearray(json.dumps(base).encode())
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data[: rng.randint(0, len(data))])


ENDPOINTS = [  # (part, path, a well-formed body)
    ("proxy", "/v1/chat/completions", CHAT),
    ("proxy", "/v1/completions", COMPLETION),
    ("render", "/v1/chat/completions/render", CHAT),
    ("render", "/v1/completions/render", COMPLETION),
    ("render", "/v1/derender/pieces", PIECES),
    ("render", "/v1/chat/completions/derender", DERENDER),
    ("decode-0", "/inference/v1/generate", GENERATE),
    ("decode-0", "/inference/v1/abort_requests", {"request_ids": ["fuzz"]}),
    ("decode-0", "/inference/v1/kv/reserve", KV_ID),
    ("decode-0", "/inference/v1/kv/transfer_failed", KV_ID),
    ("prefill-0", "/inference/v1/generate", GENERATE),
]


def fuzz(url: str, base: dict, seed: int, seconds: float) -> list[str]:
    """Server errors seen (status and body) while fuzzing one endpoint."""
    rng = random.Random(seed)
    errors = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=60, headers=HEADERS) as client:
        for body in mutations(base, rng):
            if time.monotonic() > deadline:
                break
            response = client.post(url, content=body)
            if response.status_code >= 500:
                errors.append(f"{response.status_code} for {body[:200]!r}: {response.text[:300]}")
    return errors


def greedy_stream(base: str) -> list[int]:
    body = {**COMPLETION, "max_tokens": 48, "temperature": 0, "stream": True, "return_token_ids": True}
    token_ids: list[int] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    token_ids += choice.get("token_ids") or []
    return token_ids


def fuzz_alongside_a_stream(proxy: str, targets: list[tuple[str, str, dict]]) -> None:
    expected = greedy_stream(proxy)
    seen: list[list[int]] = []
    streamer = threading.Thread(target=lambda: seen.append(greedy_stream(proxy)))
    streamer.start()
    errors: list[str] = []
    for seed, (url, path, base) in enumerate(targets):
        errors += fuzz(url + path, base, seed, FUZZ_SECONDS_PER_ENDPOINT)
    streamer.join()
    assert errors == []
    assert seen == [expected]
    assert greedy_stream(proxy) == expected  # and it still serves


def test_random_fuzz_of_every_up_endpoint(up):
    fuzz_alongside_a_stream(up["proxy"], [(up[part], path, base) for part, path, base in ENDPOINTS])
    for url in up.values():
        assert httpx.get(url + "/health", headers=HEADERS, timeout=10).status_code == 200


def test_random_fuzz_of_every_serve_endpoint(serve):
    fuzz_alongside_a_stream(serve, [(serve, path, base) for part, path, base in ENDPOINTS if part == "proxy"])
    assert httpx.get(serve + "/health", timeout=10).status_code == 200
