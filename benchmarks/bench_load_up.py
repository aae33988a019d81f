"""Load through `splitserve up`: 256 concurrent streaming completions × 4 rounds (greedy,
ignore_eos, the tiny model), after one warm-up round of the same. Prints the errors of
each round (refused, cut, in-band) and the resident memory (VmRSS, /proc/<pid>/status) of
every part `up` started, after the warm-up and at the end: each must end within 10% of
its post-warm-up level (the exit status says whether all did).

    .venv/bin/python benchmarks/bench_load_up.py [--streams 256] [--rounds 4] [--tokens 32] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_pd_streaming import tiny_model
from bench_render import free_port, served

RSS_TOLERANCE = 0.10


async def one_stream(client: httpx.AsyncClient, base: str, index: int, tokens: int) -> str | None:
    """None when the stream finished with all its tokens; else what went wrong."""
    body = {
        "prompt": f"request {index % 16}: the cache, the prefill and the decode of this request",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    finish_reason = None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "choices" not in event:
                        return f"in-band: {line[:200]}"
                    finish_reason = event["choices"][0].get("finish_reason") or finish_reason
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if finish_reason == "length" else f"finish_reason {finish_reason}"


async def round_of_streams(base: str, streams: int, tokens: int) -> tuple[list[str], float]:
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        results = await asyncio.gather(*(one_stream(client, base, i, tokens) for i in range(streams)))
    return [r for r in results if r is not None], time.monotonic() - started


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) if match else 0


def up_parts(log: Path) -> dict[str, int]:
    """The parts `up` printed once all answered: name -> pid."""
    deadline = time.monotonic() + 60
    while "OpenAI API:" not in log.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"up printed no parts:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    found = re.findall(r"^\s+(\S+)\s+http://\S+\s+\(pid (\d+)\)", log.read_text(), re.M)
    return {name: int(pid) for name, pid in found}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    args = parser.parse_args()

    port = free_port()
    command = [sys.executable, "-m", "splitserve.cli", "up", tiny_model(args.model), "--port", str(port)]
    command += ["--num-blocks", "2048", "--min-prefill-tokens", "8", "--pd-decision", "threshold"]
    with served(command, port, "load-up") as base:
        parts = up_parts(Path(tempfile.gettempdir()) / f"bench-load-up-{port}.log")
        errors, seconds = asyncio.run(round_of_streams(base, args.streams, args.tokens))
        print(f"warm-up: {args.streams} streams in {seconds:.1f} s, {len(errors)} errors")
        warm = {name: rss_kib(pid) for name, pid in parts.items()}
        total_errors = 0
        for index in range(args.rounds):
            errors, seconds = asyncio.run(round_of_streams(base, args.streams, args.tokens))
            total_errors += len(errors)
            print(f"round {index + 1}: {args.streams} streams in {seconds:.1f} s, {len(errors)} errors")
            for error in sorted(set(errors))[:5]:
                print(f"    {error}")
        end = {name: rss_kib(pid) for name, pid in parts.items()}
    print(f"\n{'part':<12}{'pid':>8}{'RSS warm MiB':>14}{'RSS end MiB':>13}{'change':>9}")
    within = True
    for name, pid in parts.items():
        change = (end[name] - warm[name]) / max(warm[name], 1)
        within &= abs(change) <= RSS_TOLERANCE
        print(f"{name:<12}{pid:>8}{warm[name] / 1024:>14.1f}{end[name] / 1024:>13.1f}{change:>+9.1%}")
    print(
        f"\nerrors after warm-up: {total_errors} of {args.streams * args.rounds}; "
        f"RSS of every part within {RSS_TOLERANCE:.0%}: {'yes' if within else 'no'}"
    )
    return 0 if total_errors == 0 and within else 1


if __name__ == "__main__":
    sys.exit(main())
