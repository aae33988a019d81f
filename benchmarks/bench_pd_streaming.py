"""P/D streaming overhead: `splitserve up` (proxy → render tier over HTTP, prefill and decode
engines) against `splitserve serve` (one process), on the same CPU cores and tiny model.

1. N concurrent streaming chats of T tokens each (default 256 x 32, greedy, ignore_eos,
   prompts long enough to go through the prefill worker), --repeats rounds per server: the
   CPU seconds every server process spent per round (user + system, from /proc; the
   client's own are not counted) and the wall time. The client is a plain HTTP/1.1 one
   over asyncio streams, one keep-alive connection per stream: httpx's pool, scanned on
   every request, cost more CPU than `serve` itself at 256 connections (and its second
   round over kept-alive connections took 7x the first), which the cores' sharing turned
   into the servers' figure.
2. Bytes the proxy sends per derender call (`POST /v1/derender/pieces`) at turn 1 and
   turn 40 of one long chat, against what the vLLM-shaped streaming derender
   (`/v1/chat/completions/derender`, the chat request in every call) would send.

    .venv/bin/python benchmarks/bench_pd_streaming.py [--streams 256] [--tokens 32] [--model DIR]

Ratios last: up / serve CPU per streamed token (the aim is at most 1.3x) and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_render import free_port, served

from splitserve.protocol.frontend_client import DerenderPiece
from splitserve.protocol.openai_api import ChatCompletionRequest
from splitserve.runtime.http_frontend_client import HTTPFrontendClient

QUESTION = "Tell me about the cache, the prefill and the decode of this request, in a few words please."


def tiny_model(path: str | None) -> str:
    if path:
        return path
    target = Path(tempfile.gettempdir()) / "splitserve-bench-pd-streaming-model"
    if not (target / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-m", "splitserve.cli", "tiny-model", str(target)], check=True)
    return str(target)


def chat_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


class LeanStream:
    """One keep-alive HTTP/1.1 connection that posts a streaming chat and reads its chunked
    SSE answer to the end: the least client CPU per event Python allows."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, base: str) -> LeanStream:
        host, _, port = base.removeprefix("http://").partition(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def chat(self, body: bytes) -> int:
        """The completion tokens of one streamed chat (its usage chunk)."""
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise SystemExit(f"the server answered {status.decode().strip()}")
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass  # headers: the body is chunked (a stream)
        events = b""
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            events += chunk[:-2]
        for line in reversed(events.split(b"\n")):
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    return usage["completion_tokens"]
        return 0

    def close(self) -> None:
        self.writer.close()


def servers_cpu_s() -> float:
    """CPU seconds (user + system) of every live process below this one: the server under
    test, all of its parts."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    below, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return sum(cpu[pid] for pid in below)


class Round(NamedTuple):
    wall_s: float
    cpu_s: float  # the servers' CPU seconds


async def load(base: str, streams: int, tokens: int, repeats: int) -> list[Round]:
    """`repeats` rounds of `streams` concurrent streams, each on a connection of its own."""
    body = chat_body(tokens)
    connections = [await LeanStream.open(base) for _ in range(streams)]
    try:
        await connections[0].chat(body)  # warm-up
        rounds = []
        for _ in range(repeats):
            cpu_before, start = servers_cpu_s(), time.perf_counter()
            counts = await asyncio.gather(*(c.chat(body) for c in connections))
            rounds.append(Round(time.perf_counter() - start, servers_cpu_s() - cpu_before))
            if any(count != tokens for count in counts):
                raise SystemExit(f"a stream ended early: {sorted(set(counts))} tokens")
        return rounds
    finally:
        for connection in connections:
            connection.close()


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
        output = list(prompt.generate.token_ids[-tokens:])  # any valid token IDs will do
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


def measure(args: argparse.Namespace, name: str, command: list[str]) -> Round:
    """Start the server, run the load --repeats times, print the rounds; the median CPU
    and the fastest wall time."""
    port = free_port()
    with served([*command, "--port", str(port)], port, name) as base:
        rounds = asyncio.run(load(base, args.streams, args.tokens, args.repeats))
    figure = Round(min(r.wall_s for r in rounds), statistics.median(r.cpu_s for r in rounds))
    per_token_us = figure.cpu_s / (args.streams * args.tokens) * 1e6
    text = " ".join(f"{r.wall_s:.2f}/{r.cpu_s:.2f}" for r in rounds)
    print(
        f"{name + ':':<6} {args.streams} streams x {args.tokens} tokens: {figure.cpu_s:.2f} CPU s "
        f"({per_token_us:.0f} us per token), {figure.wall_s:.2f} s wall (rounds, wall/CPU s: {text})",
        flush=True,
    )
    return figure


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random model)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per server (median CPU, fastest wall)")
    args = parser.parse_args()
    model = tiny_model(args.model)
    cli = [sys.executable, "-m", "splitserve.cli"]
    engine_flags = ["--num-blocks", "4096", "--max-num-seqs", str(args.streams)]

    serve = measure(args, "serve", [*cli, "serve", model, *engine_flags, "--log-level", "warning"])
    up = measure(
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

    print(
        f"\nratio up / serve: CPU per streamed token {up.cpu_s / serve.cpu_s:.2f}x (aim: at most 1.3x), "
        f"wall time {up.wall_s / serve.wall_s:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
