"""Render tier speed: splitserve `render` vs vLLM `launch render`, same model, same requests.

Two cases, each request over HTTP (`POST /v1/chat/completions/render`, keep-alive):
 (a) a ~6,500-token single-turn chat (system + one long user message), a fresh text for
     every request so no cache can help;
 (b) turn 40 of a growing agent-style conversation: the whole history is resent every
     turn; turns 1..39 are sent first (as a client would), turn 40 is timed. A fresh
     conversation for every sample.
Both servers run at once and each request goes to both back to back (order alternating),
so the shared machine's load falls on both alike. Both must return the same token IDs.
The bench model (PEERS.md / issue 3): qwen3, 2 layers, hidden 128, 32k byte-level BPE
vocabulary, 32k positions.

    .venv/bin/python benchmarks/bench_render.py [--model DIR] [--samples 8] [--skip-vllm]

Ratios (vLLM time / splitserve time) are printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx

from splitserve.runtime.ports import pick_free_port as free_port
from splitserve.runtime.process_lifetime import child_command

ROOT = Path(__file__).resolve().parents[1]
VLLM_BIN = "/work/vllm-peer/bin/vllm"
BENCH_MODEL_FLAGS = [
    "--arch", "qwen3", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
    "--vocab", "32768", "--max-position", "32768",
]  # fmt: skip
VLLM_PARSER_FLAGS = [
    "--reasoning-parser",
    "qwen3",
    "--tool-call-parser",
    "hermes",
    "--enable-auto-tool-choice",
]
WORDS = (
    "the model cache prefill decode request server engine stream answer question reason think tool "
    "call function weather city today data value result error python json list number string token "
    "block hash router replica conversation template render tokenizer latency goodput budget batch"
).split()


@contextlib.contextmanager
def served(command: list[str], port: int, name: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start a server, wait for /health, yield its base URL, always stop it."""
    log = Path(tempfile.gettempdir()) / f"bench-{name}-{port}.log"
    if command[:3] == [sys.executable, "-m", "splitserve.cli"]:
        command = child_command(command[3:])  # a benchmark killed outright leaves no stack behind
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Streamed(NamedTuple):
    ttft: float  # seconds to the first event with a choice
    choices: list[dict]  # the first choice of every event that had one
    usage: dict  # the final usage (stream_options.include_usage)


async def stream_openai(client: httpx.AsyncClient, url: str, body: dict) -> Streamed:
    """POST a streaming OpenAI request and collect its events."""
    start, ttft, choices, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                choices.append(event["choices"][0])
            usage = event.get("usage") or usage
    return Streamed(ttft or 0.0, choices, usage)


def splitserve_render(model: str, port: int) -> contextlib.AbstractContextManager[str]:
    command = [sys.executable, "-m", "splitserve.cli", "render", model, "--port", str(port),
               "--state-key", "bench-key-0123456789", "--log-level", "warning"]  # fmt: skip
    return served(command, port, "splitserve-render")


def vllm_render(model: str, port: int) -> contextlib.AbstractContextManager[str]:
    command = [VLLM_BIN, "launch", "render", model, "--port", str(port), *VLLM_PARSER_FLAGS]
    return served(command, port, "vllm-render", env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def ensure_model(path: str | None) -> str:
    if path:
        return path
    target = Path(tempfile.gettempdir()) / "splitserve-bench-render-model"
    if not (target / "tokenizer.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "tiny-model", str(target), *BENCH_MODEL_FLAGS],
            check=True,
        )
    return str(target)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.08 else "") for _ in range(n))


def single_turn(seed: int) -> dict:
    rng = random.Random(seed)
    return {
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " + words(rng, 60)},
            {"role": "user", "content": words(rng, 3150)},
        ],
        "max_tokens": 64,
    }


def conversation_turn(seed: int, turns: int) -> dict:
    """The request of turn `turns` of conversation `seed`: the history so far + a new user message."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a coding agent. " + words(rng, 80)}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: " + words(rng, 60)})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": words(rng, 80)})
    return {"messages": messages, "max_tokens": 64}


def timed(client: httpx.Client, base: str, body: dict) -> tuple[float, list[int]]:
    start = time.perf_counter()
    response = client.post(base + "/v1/chat/completions/render", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response.json()["token_ids"]


Results = dict[str, tuple[list[float], list[list[int]]]]  # case -> (seconds, token IDs) per sample


def run_cases(bases: dict[str, str], samples: int) -> dict[str, Results]:
    """Every request goes to every server back to back (the order alternating per sample),
    so the load of this shared machine falls on both alike."""
    results: dict[str, Results] = {name: {"a": ([], []), "b": ([], [])} for name in bases}

    def record(client: httpx.Client, case: str, body: dict, sample: int) -> None:
        names = list(bases) if sample % 2 == 0 else list(reversed(bases))
        for name in names:
            elapsed, ids = timed(client, bases[name], body)
            results[name][case][0].append(elapsed)
            results[name][case][1].append(ids)

    with httpx.Client(timeout=120) as client:
        for base in bases.values():
            timed(client, base, single_turn(10_000))  # warm-up: template compile, connections
        for i in range(samples):
            record(client, "a", single_turn(i), i)
        for i in range(samples):
            for turn in range(1, 40):
                for base in bases.values():
                    timed(client, base, conversation_turn(1000 + i, turn))
            record(client, "b", conversation_turn(1000 + i, 40), i)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: build the bench model)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    model = ensure_model(args.model)

    with contextlib.ExitStack() as servers:
        bases = {"splitserve": servers.enter_context(splitserve_render(model, free_port()))}
        if not args.skip_vllm:
            bases["vllm"] = servers.enter_context(vllm_render(model, free_port()))
        measured = run_cases(bases, args.samples)

    names = {"a": "(a) single turn", "b": "(b) turn 40"}
    print(f"\nmodel {model}, {args.samples} samples per case, median (mean) ms per request over HTTP")
    for case, label in names.items():
        tokens = statistics.mean(len(ids) for ids in measured["splitserve"][case][1])
        row = f"{label:<18} {tokens:>7.0f} tokens"
        for name, results in measured.items():
            times = results[case][0]
            row += f"   {name} {statistics.median(times) * 1e3:7.2f} ({statistics.mean(times) * 1e3:6.2f})"
        print(row)
    if "vllm" in measured:
        for case, label in names.items():
            same = measured["vllm"][case][1] == measured["splitserve"][case][1]
            print(f"{label}: token IDs identical to vLLM's: {'yes' if same else 'NO'}")
        print("\nratio (vLLM time / splitserve time, median; > 1 means splitserve is faster):")
        for case, label in names.items():
            ratio = statistics.median(measured["vllm"][case][0]) / statistics.median(
                measured["splitserve"][case][0]
            )
            print(f"  {label}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
