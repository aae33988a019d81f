"""P/D streaming overhead: `splitserve up` (proxy → render tier over HTTP, prefill and decode
engines) against `splitserve serve` (one process), on the same CPU cores and tiny model.

1. Wall time of N concurrent streaming chats of T tokens each (default 256 x 32, greedy,
   ignore_eos, prompts long enough to go through the prefill worker); the fastest of
   --repeats rounds per server, as the cores may be shared.
2. Bytes the proxy sends per derender call (`POST /v1/derender/pieces`) at turn 1 and
   turn 40 of one long chat, against what the vLLM-shaped streaming derender
   (`/v1/chat/completions/derender`, the chat request in every call) would send.

    .venv/bin/python benchmarks/bench_pd_streaming.py [--streams 256] [--tokens 32] [--model DIR]

The ratio (up wall time / serve wall time; the aim is under 2) is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_render import free_port, served

from splitserve.protocol.frontend_client import DerenderPiece
from splitserve.runtime.http_frontend_client import HTTPFrontendClient
from splitserve.runtime.http_pool import pooled_client
from splitserve.protocol.openai_api import ChatCompletionRequest

QUESTION = "Tell me about the cache, the prefill and the decode of this request, in a few words please."


def tiny_model(path: str | None) -> str:
    if path:
        return path
    target = Path(tempfile.gettempdir()) / "splitserve-bench-pd-streaming-model"
    if not (target / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-m", "splitserve.cli", "tiny-model", str(target)], check=True)
    return str(target)


async def one_stream(client: httpx.AsyncClient, base: str, tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    completion_tokens = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    completion_tokens = usage["completion_tokens"]
    return completion_tokens


async def load(base: str, streams: int, tokens: int, repeats: int) -> list[float]:
    """Wall time of each of `repeats` rounds of `streams` concurrent streams."""
    times = []
    async with pooled_client(read_timeout_s=600, keepalive=streams + 8) as client:
        await one_stream(client, base, tokens)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            counts = await asyncio.gather(*(one_stream(client, base, tokens) for _ in range(streams)))
            times.append(time.perf_counter() - start)
            if any(count != tokens for count in counts):
                raise SystemExit(f"a stream ended early: {sorted(set(counts))} tokens")
    return times


def conversation(turns: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "Answer briefly."}]
    for turn in range(turns - 1):
        messages.append({"role": "user", "content": f"Question {turn}: {QUESTION}"})
        messages.append({"role": "assistant", "content": f"Answer {turn}: the cache holds the prefix."})
    messages.append({"role": "user", "content": QUESTION})
    return messages


async def derender_bytes(render: str, turns: int, tokens: int) -> tuple[float, float]:
    """Mean request bytes per derender call, one token per call: (ours, vLLM-shaped)."""
    sizes: list[int] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/v1/derender/pieces":
            sizes.append(len(request.content))

    chat = {"messages": conversation(turns), "max_tokens": tokens, "stream": True}
    async with httpx.AsyncClient(timeout=60, event_hooks={"request": [record]}) as http:
        frontend = HTTPFrontendClient(render, client=http)
        prompt = await frontend.render_chat(ChatCompletionRequest.model_validate(chat))
        state = prompt.state
        output = prompt.generate["token_ids"][-tokens:]  # any valid token IDs will do
        vllm_sizes = []
        for i, token in enumerate(output):
            last = i == len(output) - 1
            piece = DerenderPiece(state, 0, [token], None, "length" if last else None, last)
            (result,) = await frontend.derender([piece])
            state = result.state
            vllm_body = {
                "stream": True,
                "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [token]}]},
                "stream_state": "x" * 400,  # about the size of a signed state
                "chat_request": chat,
            }
            vllm_sizes.append(len(json.dumps(vllm_body)))
    return sum(sizes) / len(sizes), sum(vllm_sizes) / len(vllm_sizes)


def fastest(args: argparse.Namespace, name: str, command: list[str]) -> float:
    """Start the server, run the load --repeats times, print the rounds; the fastest."""
    port = free_port()
    with served([*command, "--port", str(port)], port, name) as base:
        times = asyncio.run(load(base, args.streams, args.tokens, args.repeats))
    rounds = " ".join(f"{t:.2f}" for t in times)
    load_text = f"{args.streams} streams x {args.tokens} tokens"
    print(f"{name + ':':<6} {load_text} in {min(times):.2f} s (rounds: {rounds})", flush=True)
    return min(times)


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random model)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per server; the fastest counts")
    args = parser.parse_args()
    model = tiny_model(args.model)
    cli = [sys.executable, "-m", "splitserve.cli"]
    engine_flags = ["--num-blocks", "4096", "--max-num-seqs", str(args.streams)]

    serve_s = fastest(args, "serve", [*cli, "serve", model, *engine_flags, "--log-level", "warning"])
    up_s = fastest(
        args,
        "up",
        [
            *cli,
            "up",
            model,
            "--num-blocks",
            "4096",
            "--min-prefill-tokens",
            "16",
            "--pd-decision",
            "threshold",
        ],
    )

    port = free_port()
    render = [*cli, "render", model, "--port", str(port), "--log-level", "warning"]
    with served(render, port, "render") as base:
        print("\nbytes per derender call, one token per call")
        print(f"{'turn':>5} {'splitserve pieces':>18} {'vLLM-shaped':>12}")
        for turns in (1, 40):
            ours, theirs = asyncio.run(derender_bytes(base, turns, 16))
            print(f"{turns:>5} {ours:>18.0f} {theirs:>12.0f}")

    print(f"\nratio up / serve wall time: {up_s / serve_s:.2f}x (aim: under 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
