"""How fast can `splitserve bench`'s client ingest a stream, so that its numbers measure the
server and not itself?

A local fake OpenAI server (tests/bench/fake_openai_server.py) streams chat chunks as fast
as it can (several SSE events per write, no delays). Three clients read the same workload
from it, side by side in this run, with the same concurrency:
  - splitserve bench (its Python API: the load generator, streaming client and metrics);
  - vLLM's `vllm bench serve` (openai-chat backend) from /work/vllm-peer, the peer;
  - the official `openai` client's async streaming loop, a second reference.
Each is run `--repeats` times alternately; the best run of each counts (the machine is
shared). Figures: output tokens/s ingested over the benchmark window and, for the
in-process clients, client CPU microseconds per token. The ratio to vLLM is printed last.

Run: .venv/bin/python benchmarks/bench_client_overhead.py [--requests 32 --output-len 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitserve.bench.client import ClientConfig  # noqa: E402
from splitserve.bench.load import LoadSpec  # noqa: E402
from splitserve.bench.metrics import SLO  # noqa: E402
from splitserve.bench.runner import BenchPlan, run_benchmark  # noqa: E402
from splitserve.bench.workload import PromptFactory, SessionFactory, SyntheticSpec, Tokenizer  # noqa: E402
from splitserve.goodput import Lengths  # noqa: E402
from splitserve.model.tiny import write_tiny_model  # noqa: E402
from tests.conftest import free_port  # noqa: E402

VLLM = Path("/work/vllm-peer/bin/vllm")


class Measurement(NamedTuple):
    tokens: int
    seconds: float  # the benchmark window
    cpu_seconds: float | None  # client process CPU time, when measured in-process

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_us_per_token(self) -> float | None:
        return None if self.cpu_seconds is None else self.cpu_seconds / self.tokens * 1e6


@contextlib.contextmanager
def fast_server(events_per_write: int) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.fake_openai_server", "--port", str(port),
         "--events-per-write", str(events_per_write)],
        cwd=ROOT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait()


def splitserve_client(url: str, tokenizer_dir: str, args: argparse.Namespace) -> Measurement:
    prompts = PromptFactory(Tokenizer(tokenizer_dir), seed=0)
    spec = SyntheticSpec(Lengths.fixed(args.input_len), Lengths.fixed(args.output_len))
    load = LoadSpec(rate=float("inf"), concurrency=args.concurrency, num_requests=args.requests, warmup=0)
    plan = BenchPlan(ClientConfig(url, "fake-model"), (load,), (SLO.parse("ttft=2s"),))
    workload = SessionFactory(prompts, spec, seed=0)
    cpu = time.process_time()
    result = run_benchmark(plan, workload, settings={})
    cpu = time.process_time() - cpu
    summary = result.levels[0].summary
    assert summary.failed == 0, summary.errors
    tokens = sum(r.output_tokens for r in result.levels[0].records)
    return Measurement(tokens, summary.duration, cpu)


def openai_client(url: str, args: argparse.Namespace) -> Measurement:
    from openai import AsyncOpenAI

    async def main() -> tuple[int, float]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        limit = asyncio.Semaphore(args.concurrency)
        prompt = " ".join(["hello"] * args.input_len)

        async def one() -> int:
            async with limit:
                stream = await client.chat.completions.create(
                    model="fake-model",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.output_len,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                times, tokens = [], 0
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        times.append(time.perf_counter())
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(args.requests)))
        seconds = time.perf_counter() - start
        await client.close()
        return sum(counts), seconds

    cpu = time.process_time()
    tokens, seconds = asyncio.run(main())
    return Measurement(tokens, seconds, time.process_time() - cpu)


def vllm_bench_serve(url: str, tokenizer_dir: str, args: argparse.Namespace) -> Measurement:
    proc = subprocess.run(
        [str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", url,
         "--endpoint", "/v1/chat/completions", "--model", "fake-model", "--tokenizer", tokenizer_dir,
         "--dataset-name", "random", "--random-input-len", str(args.input_len),
         "--random-output-len", str(args.output_len), "--num-prompts", str(args.requests),
         "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--ignore-eos",
         "--disable-tqdm"],
        cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    duration = re.search(r"Benchmark duration \(s\):\s+([0-9.]+)", out)
    tokens = re.search(r"Total generated tokens:\s+([0-9]+)", out)
    failed = re.search(r"Failed requests:\s+([0-9]+)", out)
    if not (duration and tokens and failed) or int(failed.group(1)):
        raise RuntimeError(f"vllm bench serve did not report a clean run:\n{out[-3000:]}")
    return Measurement(int(tokens.group(1)), float(duration.group(1)), None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--events-per-write", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    peers = {"splitserve bench": None, "vllm bench serve": None, "openai client loop": None}
    with tempfile.TemporaryDirectory() as tmp, fast_server(args.events_per_write) as url:
        tokenizer_dir = str(write_tiny_model(Path(tmp) / "tiny"))
        runs = {
            "splitserve bench": lambda: splitserve_client(url, tokenizer_dir, args),
            "vllm bench serve": (lambda: vllm_bench_serve(url, tokenizer_dir, args))
            if VLLM.exists()
            else None,
            "openai client loop": lambda: openai_client(url, args),
        }
        for repeat in range(args.repeats):
            for name, measure in runs.items():
                if measure is None or (name == "openai client loop" and repeat):
                    continue  # the openai loop is ~15x slower: one run of it is enough
                m = measure()
                print(f"  run {repeat + 1} {name:20s} {m.tokens_per_s:>12,.0f} tokens/s", flush=True)
                if peers[name] is None or m.tokens_per_s > peers[name].tokens_per_s:
                    peers[name] = m

    print(
        f"\nclient ingest from a fast local fake server: {args.requests} requests x {args.output_len} "
        f"tokens, concurrency {args.concurrency}, {args.events_per_write} SSE events per server write, "
        f"best of {args.repeats}"
    )
    print(f"{'client':22s} {'tokens/s':>12s} {'CPU us/token':>13s}")
    for name, m in peers.items():
        if m is None:
            print(f"{name:22s} {'(not installed)':>12s}")
            continue
        cpu = f"{m.cpu_us_per_token:.1f}" if m.cpu_us_per_token is not None else "-"
        print(f"{name:22s} {m.tokens_per_s:>12,.0f} {cpu:>13s}")
    ours = peers["splitserve bench"]
    reference_name = "vllm bench serve" if peers["vllm bench serve"] else "openai client loop"
    reference = peers[reference_name]
    ratio = ours.tokens_per_s / reference.tokens_per_s
    print(f"ratio splitserve bench / {reference_name} (tokens/s): {ratio:.2f}")


if __name__ == "__main__":
    main()
