"""KV-keeping migration: how long a stream pauses when its decode worker dies mid-stream at
3k context, resumed from what the deployment still holds vs recomputed from scratch.

One `up` (1 prefill, 2 decode). Each sample streams a fresh 3,000-token prompt (token IDs,
greedy); after `--kill-after` tokens the decode worker serving it gets SIGKILL, and the
proxy resumes the stream on the other decode worker from prompt + tokens streamed so far:
- kept: the prefill worker still holds the prompt's blocks in its prefix cache, so it
  computes only the tail (the last partial block and the streamed tokens) and pushes the
  whole prompt's KV to the new decode worker;
- recomputed: the prefill worker is killed first (its retained blocks go with it), so the
  new decode worker computes the whole context itself (a full recompute).
The resume time is the longest pause between two streamed tokens (the kill falls in it).
Every stream must equal its undisturbed greedy run (run afterwards, same prompt).

    .venv/bin/python benchmarks/bench_migration_resume.py [--model DIR] [--samples 3]

The machine may be shared: figures are rough. The ratio (kept / recomputed) is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_render import free_port, served

TOKEN = "bench-migration-token"
MODEL_FLAGS = [
    "--arch", "qwen3", "--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2",
    "--vocab", "4096", "--max-position", "8192",
]  # fmt: skip


def ensure_model(path: str | None) -> str:
    if path:
        return path
    target = Path(tempfile.gettempdir()) / "splitserve-bench-migration-model"
    if not (target / "tokenizer.json").is_file():
        command = [sys.executable, "-m", "splitserve.cli", "tiny-model", str(target), *MODEL_FLAGS]
        subprocess.run(command, check=True)
    return str(target)


def up_log(port: int) -> str:
    return (Path(tempfile.gettempdir()) / f"bench-up-{port}.log").read_text()


def part_urls(port: int) -> dict[str, str]:
    return dict(re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid \d+\)", up_log(port), re.M))


def part_pid(port: int, name: str) -> int:
    log = up_log(port)
    started = re.findall(rf"^\s+{name}\s+http://\S+\s+\(pid (\d+)\)", log, re.M)
    started += re.findall(rf"{name} started again \(pid (\d+)\)", log)
    return int(started[-1])


def busy_decode(port: int) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    while True:
        for name, url in part_urls(port).items():
            if name.startswith("decode"):
                stats = httpx.get(f"{url}/inference/v1/stats", headers=auth, timeout=10).json()
                if stats["num_running"] + stats["num_waiting"] > 0:
                    return name


def kill(port: int, name: str) -> None:
    pid = part_pid(port, name)
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}") and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text():
        time.sleep(0.005)


def wait_all_healthy(base: str) -> None:
    """Until `up` has started the killed parts again and the proxy routes to them."""
    deadline = time.monotonic() + 180
    while True:
        workers = httpx.get(f"{base}/workers", timeout=10).json()["workers"]
        if all(w["healthy"] for w in workers):
            try:
                if httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).is_success:
                    return
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError("the stack did not come back")
        time.sleep(0.2)


def warm_engines(port: int) -> None:
    """One small request straight to each engine: a (re)started engine's first request
    also loads its kernels, which must not count as resume time."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"token_ids": list(range(300, 364)), "sampling_params": {"max_tokens": 2, "temperature": 0}}
    for name, url in part_urls(port).items():
        if name.startswith(("prefill", "decode")):
            response = httpx.post(f"{url}/inference/v1/generate", json=body, headers=auth, timeout=300)
            response.raise_for_status()


async def stream(
    base: str, prompt: list[int], max_tokens: int, on_tokens=None
) -> tuple[list[int], list[float]]:
    """(token IDs, arrival time of each event); `on_tokens(count)` after each event."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    tokens: list[int] = []
    times: list[float] = []
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{base}/v1/completions", json=body) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "choices" not in event:
                raise RuntimeError(f"in-band error: {line}")
            for choice in event["choices"]:
                tokens += choice.get("token_ids") or []
            times.append(time.perf_counter())
            if on_tokens is not None:
                await on_tokens(len(tokens))
    return tokens, times


async def resume_time(base: str, port: int, prompt: list[int], args: argparse.Namespace, keep: bool) -> float:
    killed: list[float] = []

    async def maybe_kill(count: int) -> None:
        if count >= args.kill_after and not killed:
            victim = await asyncio.to_thread(busy_decode, port)
            if not keep:
                await asyncio.to_thread(kill, port, "prefill-0")
            await asyncio.to_thread(kill, port, victim)
            killed.append(time.perf_counter())

    tokens, times = await stream(base, prompt, args.max_tokens, maybe_kill)
    after = [t for t in times if t >= killed[0]]
    gaps = [b - a for a, b in zip([killed[0], *after], after, strict=False)]
    await asyncio.to_thread(wait_all_healthy, base)
    await asyncio.to_thread(warm_engines, port)
    reference, _ = await stream(base, prompt, args.max_tokens)
    if tokens != reference:
        raise RuntimeError(
            f"the resumed stream differs from its undisturbed run ({'kept' if keep else 'recomputed'})"
        )
    return max(gaps)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: a 4-layer random qwen3 (hidden 256)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--kill-after", type=int, default=24, help="streamed tokens before the kill")
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    model = ensure_model(args.model)
    port = free_port()
    command = [sys.executable, "-m", "splitserve.cli", "up", model, "--port", str(port), "--decode", "2"]
    command += ["--num-blocks", "2048", "--max-model-len", str(args.prompt_tokens + args.max_tokens + 64)]
    rng = random.Random(0)
    with served(command, port, "up", env={"SPLITSERVE_INTERNAL_TOKEN": TOKEN}) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        warm_engines(port)
        kept, recomputed = [], []
        for sample in range(args.samples):
            for keep, times in ((True, kept), (False, recomputed)):
                prompt = [rng.randrange(300, 4000) for _ in range(args.prompt_tokens)]
                times.append(asyncio.run(resume_time(base, port, prompt, args, keep)))
                print(
                    f"sample {sample}: {'kept' if keep else 'recomputed'} resume {times[-1] * 1e3:.0f} ms",
                    flush=True,
                )
    kept_s, recomputed_s = statistics.median(kept), statistics.median(recomputed)
    print(f"prompt {args.prompt_tokens} tokens, killed after {args.kill_after}; median of {args.samples}")
    print(f"resume, KV kept (prefill's retained blocks): {kept_s * 1e3:.0f} ms")
    print(f"resume, full recompute (prefill killed too):  {recomputed_s * 1e3:.0f} ms")
    print(f"ratio kept / recomputed: {kept_s / recomputed_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
