"""AFD at two attention:FFN ratios under `splitserve up`, against the collocated MoE model,
in one run: `up --decode 1` (collocated), `up --afd 1:1` and `up --afd 2:1` (A attention
engines sharing one FFN daemon, over shared memory), each serving `--streams` concurrent
completions of `--tokens` greedy tokens (ignore_eos) through its proxy.

Per layout: output tokens/s of the whole stack and per engine process (attention engines
plus daemons: 1, 2, 3), the streams' median ITL, and from each attention engine's
/metrics per decode step: AFD bytes each way, the time held up by the daemon, the daemon's
compute, and the exposed communication (held up less compute) as a share of the step.

Honest about this machine: every process of every layout shares its cores (two on the
machines seen so far), so a layout with more processes takes turns on the same cores;
the figures say what AFD costs here, not what it gains where the daemon has chips of its
own (`splitserve sim afd` sizes that). The peer is the collocated layout, same run.

    .venv/bin/python benchmarks/bench_afd_ratios.py [--model DIR] [--hidden 256] [--streams 16 --tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_model import cpu_isa_flags
from bench_render import free_port, served

from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from splitserve.runtime.access import INTERNAL_TOKEN_ENV

TOKEN = "bench-afd-ratios"
LAYOUTS = {
    "collocated (--decode 1)": ["--decode", "1"],
    "AFD 1:1": ["--afd", "1:1"],
    "AFD 2:1": ["--afd", "2:1"],
}
PROCESSES = {"collocated (--decode 1)": 1, "AFD 1:1": 2, "AFD 2:1": 3}


class StepTraffic(NamedTuple):
    steps: int
    sent_bytes: float  # per step
    received_bytes: float
    blocked_ms: float
    compute_ms: float
    exposed_ms: float
    step_ms: float


class LayoutFigures(NamedTuple):
    tokens_per_s: float
    itl_ms: float
    traffic: list[StepTraffic]  # per attention engine
    tokens: list[list[int]]


def metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def step_traffic(text: str) -> StepTraffic:
    steps = metric_sum(text, "splitserve_afd_step_bytes_sent_count") or 1.0

    def per_step(name: str, scale: float = 1.0) -> float:
        return metric_sum(text, name) / steps * scale

    engine_steps = metric_sum(text, "splitserve_step_time_seconds_count") or 1.0
    step_ms = metric_sum(text, "splitserve_step_time_seconds_sum") / engine_steps * 1e3
    return StepTraffic(
        int(steps),
        per_step("splitserve_afd_step_bytes_sent_sum"),
        per_step("splitserve_afd_step_bytes_received_sum"),
        per_step("splitserve_afd_step_blocked_seconds_sum", 1e3),
        per_step("splitserve_afd_step_remote_compute_seconds_sum", 1e3),
        per_step("splitserve_afd_step_exposed_communication_seconds_sum", 1e3),
        step_ms,
    )


async def stream(
    client: httpx.AsyncClient, base: str, prompt: list[int], tokens: int
) -> tuple[list[int], list[float]]:
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    times: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                ids += choice.get("token_ids") or []
                times.append(time.perf_counter())
    return ids, times


async def load(base: str, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, base, prompts[0], 4)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(client, base, p, tokens) for p in prompts))
        elapsed = time.perf_counter() - started
    total = sum(len(ids) for ids, _ in results)
    gaps = [(t[-1] - t[0]) / (len(t) - 1) for _, t in results if len(t) > 1]
    return total / elapsed, statistics.median(gaps) * 1e3, [ids for ids, _ in results]


def attention_engines(log: Path) -> list[str]:
    """The decode engines' URLs, as `up` printed its parts."""
    deadline = time.monotonic() + 60
    while "OpenAI API:" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    found = re.findall(r"^\s+(decode-\d+)\s+(\S+://\S+)\s+\(pid", log.read_text(), re.M)
    return [url for _, url in found]


def measure(
    args: argparse.Namespace, model: str, name: str, flags: list[str], prompts: list[list[int]]
) -> LayoutFigures:
    port = free_port()
    command = [
        sys.executable, "-m", "splitserve.cli", "up", model, "--port", str(port), "--prefill", "0", *flags,
        "--dtype", args.dtype, "--log-level", "warning",
    ]  # fmt: skip
    print(f"\n{name}: up {' '.join(command[4:])}", flush=True)
    log = Path(tempfile.gettempdir()) / f"bench-afd-ratios-{port}.log"
    with served(command, port, "afd-ratios", env={INTERNAL_TOKEN_ENV: TOKEN}) as base:
        rate, itl, tokens = asyncio.run(load(base, prompts, args.tokens))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        traffic = [
            step_traffic(httpx.get(f"{url}/metrics", headers=auth, timeout=10).text)
            for url in (attention_engines(log) if "--afd" in flags else [])
        ]
    print(f"  {rate:.0f} tok/s, ITL p50 {itl:.1f} ms", flush=True)
    return LayoutFigures(rate, itl, traffic, tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a MoE model directory (default: a tiny Qwen3-MoE)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = args.model
    if model is None:
        folder = Path(tempfile.mkdtemp(prefix="bench-afd-ratios-model-"))
        heads = max(2, args.hidden // 64)
        spec = TinyModelSpec(
            arch="qwen3_moe", layers=args.layers, hidden=args.hidden, heads=heads,
            kv_heads=max(1, heads // 2), dtype=args.dtype,
        )  # fmt: skip
        model = str(write_tiny_model(folder, spec))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    cpus = len(os.sched_getaffinity(0))
    print(f"model {model}; {args.dtype}; ISA {cpu_isa_flags()}; {cpus} CPUs", flush=True)
    figures = {name: measure(args, model, name, flags, prompts) for name, flags in LAYOUTS.items()}

    print(
        f"\n{args.streams} streams x {args.tokens} tokens, {args.dtype}, {cpus} CPUs shared by every "
        "process; per attention engine and decode step: AFD bytes out / back, held up by the daemon, "
        "its compute, exposed"
    )
    base = figures["collocated (--decode 1)"]
    for name, f in figures.items():
        per_process = f.tokens_per_s / PROCESSES[name]
        same = "same tokens" if f.tokens == base.tokens else "TOKENS DIFFER"
        print(
            f"{name:<24} {f.tokens_per_s:7.0f} tok/s  {per_process:7.0f} per process  "
            f"ITL p50 {f.itl_ms:6.1f} ms  {same}"
        )
        for i, t in enumerate(f.traffic):
            share = t.exposed_ms / t.step_ms if t.step_ms else 0.0
            print(
                f"    decode-{i}: {t.steps} steps, {t.sent_bytes / 1024:.1f} / "
                f"{t.received_bytes / 1024:.1f} KiB, held up {t.blocked_ms:.1f} ms, daemon compute "
                f"{t.compute_ms:.1f} ms, exposed {t.exposed_ms:.1f} ms "
                f"({share:.0%} of a {t.step_ms:.1f} ms step)"
            )
    for name in ("AFD 1:1", "AFD 2:1"):
        f = figures[name]
        print(
            f"ratio {name} / collocated: throughput {f.tokens_per_s / base.tokens_per_s:.2f}x, per process "
            f"{f.tokens_per_s / PROCESSES[name] / base.tokens_per_s:.2f}x, ITL {f.itl_ms / base.itl_ms:.2f}x"
        )
    return 0 if all(f.tokens == base.tokens for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
