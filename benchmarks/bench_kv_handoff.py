"""KV handoff and the interference P/D removes, on the bench model (../shared/PEERS.md).

Part 1, handoff: a prefill and a decode engine (`splitserve engine --role prefill|decode`,
pinned to one core each), driven through the proxy's own P/D client. For shm, tcp and
nixl (when installed: `splitserve[nixl]`), push layer by layer vs pull after prefill (vLLM
NIXL's behaviour), at each prompt length (default 1k, 3k, 8k tokens), same engines, same run.
Per request the decode worker reports (kv_transfer_params.handoff):
  exposed transfer = last KV arrival on decode - prefill's last layer computed (push) or
                     prefill finished (pull: includes the proxy hop and the pull request)
  notification     = last arrival -> the decode engine picking the request up
  exposed handoff  = decode's first token - prefill's last layer (adds decode's own step)
The full transfer time of a prompt is the pull's measured transfer (pull sent -> last
layer landed) on the same transport; exposed transfer is reported as a fraction of it.
With L layers streamed while the next computes, about 1/L should remain (the seed).

Part 1b, a hybrid model beside a dense one (`--hybrid-prompt-tokens`, default 256, 1k, 8k):
the bench model and a Nemotron-H of its width and depth (4 Mamba2, 2 attention, 2 MLP
layers), push over shm, tcp (and nixl): the bytes handed over, KV and Mamba state apart, and the
exposed handoff, beside the simulator's prediction of the bytes (sim/specs.py: the KV of
the prompt's n - 1 tokens, and every Mamba layer's state, whole, whatever the length).

Part 2, interference: short prompts stream long answers while long prompts arrive.
Every engine gets one core and one thread: collocated, one `--role both` engine on core 0;
P/D, prefill on core 0 and decode on core 1 (shm push; prompts under 512 tokens skip the
prefill pool). Two threads on two shared cores stall on OpenMP barriers whenever another
process runs, which on a busy machine swamps what is measured here. Reported per config:
worst inter-token gap and p99 ITL of the streams, and the long prompts' TTFT. Ratios
(P/D vs the collocated peer, same run) are printed last.

    .venv/bin/python benchmarks/bench_kv_handoff.py [--prompt-tokens 1000 3000 8000] [--repeats 3]
        [--skip-interference] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_model import (
    DEFAULT_MODEL_DIR,
    compute_dtype,
    ensure_bench_model,
    ensure_hybrid_bench_model,
    ensure_long_bench_model,
)

from splitserve.kv.transport.nixl_package import nixl_present
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import WorkerPool
from splitserve.runtime.http_engine_client import HTTPEngineClient
from splitserve.runtime.ports import pick_free_port as free_port
from splitserve.sim.specs import load_model as load_sim_model

VOCAB = 32768


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


class Engine(NamedTuple):
    url: str
    process: subprocess.Popen


def start_engine(
    model: Path, role: str, cores: set[int], transport: str = "shm", *extra: str, max_len: int = 4096
) -> Engine:
    port = free_port()
    command = [
        sys.executable, "-m", "splitserve.cli", "engine", str(model), "--role", role, "--port", str(port),
        "--kv-transport", transport, "--kv-cache-memory", "512MiB", "--max-model-len", str(max_len),
        "--log-level", "warning", "--dtype", compute_dtype(), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
    process = subprocess.Popen(command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    return Engine(f"http://127.0.0.1:{port}", process)


def wait_healthy(engines: list[Engine], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        while True:
            if engine.process.poll() is not None:
                raise RuntimeError(f"engine {engine.url} exited with {engine.process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{engine.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine.url} did not become healthy")
            time.sleep(0.3)


def stop(engines: list[Engine]) -> None:
    for engine in engines:
        engine.process.terminate()
    for engine in engines:
        try:
            engine.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            engine.process.kill()


def body(request_id: str, tokens: list[int], max_tokens: int) -> GenerateRequest:
    """A streamed greedy request, as the engine clients take it (typed)."""
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    wire = {"request_id": request_id, "token_ids": tokens, "sampling_params": sampling, "stream": True}
    return GenerateRequest.from_wire(wire)


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


# ---- part 1: handoff ---------------------------------------------------------------------
class Handoff(NamedTuple):
    ttft_s: float
    exposed_transfer_s: float
    notification_s: float
    exposed_handoff_s: float
    wait_s: float
    num_bytes: int  # KV
    state_bytes: int  # a hybrid model's Mamba state


async def one_handoff(client: PDEngineClient, request_id: str, tokens: list[int]) -> Handoff:
    started = time.monotonic()
    ttft, final = None, {}
    async for chunk in client.generate(body(request_id, tokens, 2)):
        ttft = ttft if ttft is not None else time.monotonic() - started
        final = chunk
    handoff = (final.get("kv_transfer_params") or {}).get("handoff") or {}
    if not handoff.get("transferred"):
        raise RuntimeError(f"{request_id}: the KV did not transfer: {handoff}")
    return Handoff(
        ttft or 0.0,
        handoff["exposed_transfer_s"],
        handoff.get("notification_s", 0.0),
        handoff["exposed_handoff_s"],
        handoff["wait_s"],
        handoff["bytes"],
        handoff.get("state_bytes", 0),
    )


async def handoff_runs(
    prefill: str, decode: str, lengths: list[int], repeats: int, seed: int, modes=("push", "pull")
) -> dict[tuple[int, str], list[Handoff]]:
    """(prompt tokens, mode) -> the runs; fresh prompts every time (no prefix hits)."""
    results = {}
    for mode in modes:
        client = PDEngineClient(
            WorkerPool([prefill], [decode]), PDPolicy(min_prefill_tokens=0, mode=mode, decision="threshold")
        )
        try:
            await one_handoff(client, f"warm-{mode}-{seed}", prompt(seed, 256))
            for length in lengths:
                runs = []
                for r in range(repeats):
                    tokens = prompt(seed * 100_000 + length * 10 + r + (5 if mode == "pull" else 0), length)
                    runs.append(await one_handoff(client, f"{mode}-{seed}-{length}-{r}", tokens))
                results[(length, mode)] = runs
        finally:
            await client.close()
    return results


def handoff_transports() -> tuple[str, ...]:
    """shm and tcp, and nixl beside them where NIXL is installed (`splitserve[nixl]`)."""
    if nixl_present():
        return ("shm", "tcp", "nixl")
    print("(nixl: not installed, left out; pip install 'splitserve[nixl]')")
    return ("shm", "tcp")


def part_handoff(model: Path, lengths: list[int], repeats: int) -> dict[str, float]:
    layers = 8
    print(
        f"\n== Handoff: {'/'.join(map(str, lengths))}-token prompts, {repeats} per cell; "
        "prefill on core 0, decode on core 1 =="
    )
    header = (
        f"{'transport':<9} {'tokens':>6} {'mode':<5} {'KV MB':>6} {'TTFT ms':>8} {'full xfer ms':>12} "
        f"{'exposed ms':>10} {'of full':>8} {'notify ms':>9} {'expo.+step ms':>13}"
    )
    print(header)
    fractions: dict[str, float] = {}
    max_len = max(4096, max(lengths) + 64)
    for seed, transport in enumerate(handoff_transports(), start=1):
        engines = [
            start_engine(model, "prefill", {0}, transport, max_len=max_len),
            start_engine(model, "decode", {1}, transport, max_len=max_len),
        ]
        try:
            wait_healthy(engines)
            results = asyncio.run(handoff_runs(engines[0].url, engines[1].url, lengths, repeats, seed))
        finally:
            stop(engines)
        for length in lengths:
            full_ms = median_ms([h.wait_s for h in results[(length, "pull")]])
            for mode in ("push", "pull"):
                runs = results[(length, mode)]
                exposed = median_ms([h.exposed_transfer_s for h in runs])
                fractions[f"{transport}/{mode}/{length}"] = exposed / full_ms
                ttft = median_ms([h.ttft_s for h in runs])
                print(
                    f"{transport:<9} {length:>6} {mode:<5} {runs[0].num_bytes / 1e6:>6.1f} {ttft:>8.1f} "
                    f"{full_ms:>12.2f} {exposed:>10.2f} {exposed / full_ms:>7.0%} "
                    f"{median_ms([h.notification_s for h in runs]):>9.2f} "
                    f"{median_ms([h.exposed_handoff_s for h in runs]):>13.1f}"
                )
    print(f"(one layer's share of the transfer: 1/{layers} = {1 / layers:.0%})")
    return fractions


def part_hybrid(dense: Path, lengths: list[int], repeats: int) -> None:
    """Part 1b: what a hybrid model hands over beside a dense one of its size, measured
    and predicted (push only: a hybrid's state travels in a push)."""
    max_len = max(4096, max(lengths) + 64)
    hybrid = ensure_hybrid_bench_model(8192 * -(-max_len // 8192))
    print(
        f"\n== Hybrid vs dense handoff (push): {'/'.join(map(str, lengths))}-token prompts, "
        f"{repeats} per cell =="
    )
    print(
        f"{'model':<8} {'transport':<9} {'tokens':>6} {'KV KiB':>8} {'sim KV':>8} {'state KiB':>9} "
        f"{'sim state':>9} {'exposed handoff ms':>18}"
    )
    for seed, ((name, model), transport) in enumerate(
        itertools.product((("dense", dense), ("hybrid", hybrid)), handoff_transports()), start=10
    ):
        spec = load_sim_model(str(model))
        engines = [
            start_engine(model, "prefill", {0}, transport, max_len=max_len),
            start_engine(model, "decode", {1}, transport, max_len=max_len),
        ]
        try:
            wait_healthy(engines)
            results = asyncio.run(
                handoff_runs(engines[0].url, engines[1].url, lengths, repeats, seed, modes=("push",))
            )
        finally:
            stop(engines)
        for length in lengths:
            runs = results[(length, "push")]
            block_tokens = 16 * -(-(length - 1) // 16)  # decode's blocks for positions [0, n - 1)
            print(
                f"{name:<8} {transport:<9} {length:>6} {runs[0].num_bytes / 1024:>8.0f} "
                f"{block_tokens * spec.kv_bytes_per_token / 1024:>8.0f} {runs[0].state_bytes / 1024:>9.1f} "
                f"{spec.state_bytes_per_request / 1024:>9.1f} "
                f"{median_ms([h.exposed_handoff_s for h in runs]):>18.2f}"
            )


# ---- part 2: interference ----------------------------------------------------------------
class StreamStats(NamedTuple):
    worst_gap_s: float
    p99_itl_s: float
    median_itl_s: float
    long_ttft_s: float


async def stream_gaps(client, request_id: str, tokens: list[int], max_tokens: int) -> list[float]:
    times: list[float] = []
    async for chunk in client.generate(body(request_id, tokens, max_tokens)):
        now = time.monotonic()
        for choice in chunk.get("choices") or []:
            times += [now] * len(choice.get("token_ids") or [])
    return [b - a for a, b in itertools.pairwise(times)]


async def long_ttft(client, request_id: str, tokens: list[int], delay_s: float) -> float:
    await asyncio.sleep(delay_s)
    started = time.monotonic()
    async for _ in client.generate(body(request_id, tokens, 2)):
        return time.monotonic() - started
    return float("nan")


async def interference_run(
    client, tag: str, streams: int, long_prompts: int, long_tokens: int, stream_tokens: int
) -> StreamStats:
    # warm-up: one short and one long request, so nothing below pays first-call costs
    await stream_gaps(client, f"{tag}-warm-s", prompt(7, 64), 4)
    await long_ttft(client, f"{tag}-warm-l", prompt(8, long_tokens), 0)
    stream_tasks = [
        asyncio.ensure_future(stream_gaps(client, f"{tag}-s{i}", prompt(100 + i, 64), stream_tokens))
        for i in range(streams)
    ]
    long_tasks = [
        asyncio.ensure_future(long_ttft(client, f"{tag}-l{i}", prompt(200 + i, long_tokens), 0.5 + 1.0 * i))
        for i in range(long_prompts)
    ]
    gaps = [g for gs in await asyncio.gather(*stream_tasks) for g in gs]
    ttfts = await asyncio.gather(*long_tasks)
    gaps.sort()
    return StreamStats(
        worst_gap_s=gaps[-1],
        p99_itl_s=gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        median_itl_s=statistics.median(gaps),
        long_ttft_s=statistics.median(ttfts),
    )


def part_interference(
    model: Path,
    streams: int,
    long_prompts: int,
    long_tokens: int,
    stream_tokens: int,
    collocated_core: int = 0,
) -> dict[str, StreamStats]:
    print(
        f"\n== Interference: {streams} streams (64-token prompts, {stream_tokens} tokens each) while "
        f"{long_prompts} {long_tokens}-token prompts arrive 1 s apart; one core (one thread) per engine: "
        f"collocated on core {collocated_core}, P/D prefill on 0 and decode on 1 =="
    )
    stats: dict[str, StreamStats] = {}
    engine = start_engine(model, "both", {collocated_core})
    try:
        wait_healthy([engine])
        client = HTTPEngineClient(engine.url)
        stats["collocated"] = asyncio.run(
            interference_run(client, "co", streams, long_prompts, long_tokens, stream_tokens)
        )
    finally:
        stop([engine])
    engines = [start_engine(model, "prefill", {0}), start_engine(model, "decode", {1})]
    try:
        wait_healthy(engines)
        policy = PDPolicy(min_prefill_tokens=512, mode="push", decision="threshold")

        async def run_pd() -> StreamStats:
            client = PDEngineClient(WorkerPool([engines[0].url], [engines[1].url]), policy)
            try:
                return await interference_run(client, "pd", streams, long_prompts, long_tokens, stream_tokens)
            finally:
                await client.close()

        stats["P/D (shm push)"] = asyncio.run(run_pd())
    finally:
        stop(engines)
    print(f"(load average {os.getloadavg()[0]:.1f} at the end; the long prompts' TTFT is prefill-bound)")
    print(
        f"{'config':<16} {'worst gap ms':>12} {'p99 ITL ms':>10} {'median ITL ms':>13} {'long TTFT ms':>12}"
    )
    for name, s in stats.items():
        print(
            f"{name:<16} {1000 * s.worst_gap_s:>12.1f} {1000 * s.p99_itl_s:>10.1f} "
            f"{1000 * s.median_itl_s:>13.1f} {1000 * s.long_ttft_s:>12.1f}"
        )
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 3000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-handoff", action="store_true")
    parser.add_argument("--skip-interference", action="store_true")
    parser.add_argument("--hybrid-prompt-tokens", type=int, nargs="+", default=[256, 1024, 8192])
    parser.add_argument("--skip-hybrid", action="store_true")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=200)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two cores (prefill and decode are pinned to one each)", file=sys.stderr)
        return 2
    model = ensure_bench_model(args.model)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} at start (shared)")
    longest, handoff_model = max(args.prompt_tokens) + 64, model
    if args.model == DEFAULT_MODEL_DIR and longest > 4096:
        # the bench model holds 4096 positions: longer prompts get its shape with more
        handoff_model = ensure_long_bench_model(8192 * -(-longest // 8192))
    fractions = {} if args.skip_handoff else part_handoff(handoff_model, args.prompt_tokens, args.repeats)
    if not args.skip_hybrid:
        longest = max(args.hybrid_prompt_tokens) + 64
        dense = model if longest <= 4096 else ensure_long_bench_model(8192 * -(-longest // 8192))
        part_hybrid(dense, args.hybrid_prompt_tokens, args.repeats)
    stats = (
        {}
        if args.skip_interference
        else part_interference(model, args.streams, args.long_prompts, args.long_tokens, args.stream_tokens)
    )
    print()
    for transport, length in itertools.product(("shm", "tcp", "nixl"), args.prompt_tokens):
        if f"{transport}/push/{length}" in fractions:
            push, pull = fractions[f"{transport}/push/{length}"], fractions[f"{transport}/pull/{length}"]
            print(
                f"exposed transfer, {transport} at {length} tokens: push layer-wise {push:.0%} of the full "
                f"transfer, pull after prefill {pull:.0%}: push/pull = {push / pull:.2f}x"
            )
    if stats:
        co, pd = stats["collocated"], stats["P/D (shm push)"]
        print(
            f"P/D vs collocated (peer): worst gap {pd.worst_gap_s / co.worst_gap_s:.2f}x, "
            f"p99 ITL {pd.p99_itl_s / co.p99_itl_s:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
