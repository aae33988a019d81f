"""Multi-turn sessions that outgrow one engine's KV pool, with and without the KV store
tier: prompt tokens recomputed and TTFT over turns 2+, same run, same engine settings.

S sessions take turns round-robin (turn 1 of every session, then turn 2 of every one, ...);
each turn's prompt is the previous prompt, its answer and a new user message. The pool
holds about `--pool-sessions` sessions, so by the time a session comes back its blocks
were evicted: without a store they are recomputed; with one (`splitserve kvstore` as its
own process on 127.0.0.1) they were offloaded when evicted and load back. Requests run
one at a time through the engine API in process (`LLMEngine`), so TTFT is the engine's
own: queueing, the store lookup and load, and the prefill of what is left.

    .venv/bin/python benchmarks/bench_kv_store.py [--sessions 24] [--turns 4] [--model DIR]

Ratios last: turn 2+ prompt tokens computed (no store / store) and TTFT p90 (no store /
store).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_pd_streaming import tiny_model
from bench_render import free_port, served

from splitserve.engine.kv_store_client import KVStoreClient
from splitserve.engine.llm import engine_config_from_kwargs
from splitserve.engine.llm_engine import LLMEngine
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.sampling_params import SamplingParams

BLOCK = 16


def one_turn(
    engine: LLMEngine, wake: threading.Event, request_id: str, prompt: list[int], max_tokens: int
) -> tuple[float, int, list[int]]:
    """(TTFT, cached prompt tokens, answer) of one request run alone. While its KV loads
    the loop waits for the store client's wake-up, as AsyncEngine's does (a spinning loop
    would hold the GIL the loader thread needs)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(GenerateRequest(request_id, tuple(prompt), params))
    ttft, answer, cached = 0.0, [], 0
    while True:
        if not engine.has_runnable_work():
            wake.wait(0.05)
            wake.clear()
            continue
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.new_token_ids and not answer:
                ttft = time.perf_counter() - start
            answer.extend(out.new_token_ids)
            if out.finished:
                cached = out.num_cached_tokens
                return ttft, cached, answer


def run(args: argparse.Namespace, model: str, store_port: int | None) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, computed tokens) of every turn 2+."""
    store = KVStoreClient("127.0.0.1", store_port, None) if store_port else None
    config = engine_config_from_kwargs(model, num_blocks=args.num_blocks, block_size=BLOCK)
    engine = LLMEngine(config, kv_store=store)
    wake = threading.Event()
    if store is not None:
        store.set_wakeup(wake.set)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(300, 1800) for _ in range(args.system_tokens)] for _ in range(args.sessions)]
    rows: list[tuple[float, int, int]] = []
    try:
        for turn in range(args.turns):
            for session in range(args.sessions):
                prompt = prompts[session] + [rng.randrange(300, 1800) for _ in range(args.user_tokens)]
                ttft, cached, answer = one_turn(
                    engine, wake, f"s{session}-t{turn}", prompt, args.answer_tokens
                )
                prompts[session] = prompt + answer
                if turn > 0:
                    rows.append((ttft, len(prompt), len(prompt) - cached))
    finally:
        engine.shutdown()
    if store is not None:
        s = store.stats
        print(
            f"  store: lookups {s.lookups}, loaded {s.loaded_blocks} blocks "
            f"({s.loaded_bytes / 2**20:.1f} MiB, "
            f"{s.load_seconds / max(1, s.loads) * 1000:.2f} ms per load on average), offloaded "
            f"{s.offloaded_blocks}, dropped {s.dropped_full + s.dropped_down}, failed loads {s.failed_loads}"
        )
    return rows


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def summary(name: str, rows: list[tuple[float, int, int]]) -> tuple[int, float]:
    computed = sum(r[2] for r in rows)
    ttfts = [r[0] for r in rows]
    print(
        f"{name:<10} turns 2+: {len(rows)} requests, prompt tokens {sum(r[1] for r in rows)}, "
        f"computed {computed}, TTFT p50 {statistics.median(ttfts) * 1000:.1f} ms, "
        f"p90 {p90(ttfts) * 1000:.1f} ms"
    )
    return computed, p90(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the tiny test model")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--pool-sessions", type=int, default=4, help="sessions' worth of blocks in the pool")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = tiny_model(args.model)
    longest = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    args.num_blocks = args.pool_sessions * (longest // BLOCK + 2)
    print(
        f"{args.sessions} sessions x {args.turns} turns, up to {longest} tokens each; "
        f"pool {args.num_blocks} blocks"
    )
    without = summary("no store", run(args, model, None))
    http, kv = free_port(), free_port()
    command = [sys.executable, "-m", "splitserve.cli", "kvstore", "--port", str(http), "--kv-port", str(kv)]
    with served([*command, "--kv-store-ram-gb", "2", "--log-level", "warning"], http, "kvstore"):
        with_store = summary("store", run(args, model, kv))
    print(f"turn 2+ prompt tokens computed, no store / store: {without[0] / max(1, with_store[0]):.2f}x")
    print(f"turn 2+ TTFT p90, no store / store: {without[1] / with_store[1]:.2f}x")


if __name__ == "__main__":
    main()
