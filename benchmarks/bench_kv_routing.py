"""The proxy's routing policies over a pool of collocated-style replicas:
`splitserve up --prefill 0 --decode R --routing P` for P in cache-aware, least-loaded,
round-robin and text-prefix, on the same multi-tenant multi-turn chat workload (several
system prompts, concurrent sessions, each turn appending to its conversation; more
sessions than one replica's cache holds).

For each policy: prefix hit rate (the prompt tokens the engines did not compute, from
`usage.prompt_tokens_details.cached_tokens`), the router's own block hit rate (the
blocks of each prompt its KV index saw on the chosen worker), TTFT p50/p90 of streaming
requests (also over turns 2 and later alone: the first turn is cold for every policy), and
goodput: requests per second whose TTFT met the SLO (--ttft-slo).

    .venv/bin/python benchmarks/bench_kv_routing.py [--replicas 3] [--tenants 6] [--sessions 12] [--turns 3]

The ratios against round-robin (hit rate: the aim is >= 2; TTFT p90: the aim is <= 0.5)
are printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time

import httpx
from bench_pd_streaming import tiny_model
from bench_render import free_port, served, stream_openai

WORDS = "the of and to in is that for it as was with be by on not this are or from at".split()


def text(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def turn(
    client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int = 8
) -> tuple[float, int, int, str]:
    """(TTFT, prompt tokens, cached tokens, answer) of one streaming chat turn."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ttft, choices, usage = await stream_openai(client, f"{base}/v1/chat/completions", body)
    answer = "".join(choice["delta"].get("content") or "" for choice in choices)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, usage.get("prompt_tokens", 0), cached, answer


POLICIES = ("cache-aware", "least-loaded", "round-robin", "text-prefix")


async def workload(base: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    systems = [f"Tenant {t} instructions. " + text(rng, 120) for t in range(args.tenants)]
    sessions = [[{"role": "system", "content": systems[s % args.tenants]}] for s in range(args.sessions)]
    ttfts, warm_ttfts, prompt_tokens, cached_tokens = [], [], 0, 0
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        for turn_index in range(args.turns):
            for messages in sessions:
                messages.append({"role": "user", "content": text(rng, 20)})
            # sessions arrive in a new order each turn: in a fixed order, round-robin would
            # send every session back to its last replica whenever their count divides evenly
            order = list(range(len(sessions)))
            rng.shuffle(order)
            arriving = [sessions[i] for i in order]
            results = await asyncio.gather(*(turn(client, base, m) for m in arriving))
            for messages, (ttft, prompt, cached, answer) in zip(arriving, results, strict=True):
                messages.append({"role": "assistant", "content": answer or "ok"})
                ttfts.append(ttft)
                if turn_index:  # turn 1 is cold for every policy: nothing to hit yet
                    warm_ttfts.append(ttft)
                prompt_tokens += prompt
                cached_tokens += cached
    elapsed = time.perf_counter() - started
    metrics = httpx.get(f"{base}/metrics").text

    def counter(name: str) -> float:
        match = re.search(rf"^{name} (\S+)$", metrics, re.M)
        return float(match.group(1)) if match else 0.0

    queried = counter("splitserve_proxy_prefix_query_blocks_total")
    quantiles = statistics.quantiles(ttfts, n=10)
    return {
        "hit_rate": cached_tokens / max(prompt_tokens, 1),
        "router_hit_rate": counter("splitserve_proxy_prefix_hit_blocks_total") / max(queried, 1),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": quantiles[-1],
        "warm_ttft_p90": statistics.quantiles(warm_ttfts, n=10)[-1] if len(warm_ttfts) > 1 else 0.0,
        "goodput": sum(t <= args.ttft_slo for t in ttfts) / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=128, help="per replica: less than all tenants need")
    parser.add_argument("--ttft-slo", type=float, default=0.25, help="seconds: the goodput's TTFT SLO")
    parser.add_argument(
        "--kv-load-weight", type=float, default=None, help="cache-aware's cost per request in flight"
    )
    parser.add_argument(
        "--kv-prefill-load-weight",
        type=float,
        default=None,
        help="cache-aware's cost per block of prompt tokens queued for prefill on a replica",
    )
    parser.add_argument(
        "--kv-decode-load-weight",
        type=float,
        default=None,
        help="cache-aware's cost per KV block of a replica's decoding requests",
    )
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="round-robin always runs"
    )
    args = parser.parse_args()
    model = tiny_model(args.model)
    print(f"SLO: TTFT <= {args.ttft_slo * 1e3:.0f} ms; goodput = requests meeting it per second")
    results = {}
    policies = [policy for policy in POLICIES if policy in args.policies or policy == "round-robin"]
    for policy in policies:
        port = free_port()
        command = [sys.executable, "-m", "splitserve.cli", "up", model, "--port", str(port)]
        command += ["--prefill", "0", "--decode", str(args.replicas), "--num-blocks", str(args.num_blocks)]
        for flag, weight in (
            ("--kv-load-weight", args.kv_load_weight),
            ("--kv-prefill-load-weight", args.kv_prefill_load_weight),
            ("--kv-decode-load-weight", args.kv_decode_load_weight),
        ):
            if weight is not None:
                command += [flag, str(weight)]
        with served([*command, "--routing", policy], port, policy) as base:
            results[policy] = asyncio.run(workload(base, args))
        r = results[policy]
        print(
            f"{policy:>13}: hit rate {r['hit_rate']:.3f} (router {r['router_hit_rate']:.3f}), "
            f"TTFT p50 {r['ttft_p50'] * 1e3:.1f} ms, p90 {r['ttft_p90'] * 1e3:.1f} ms "
            f"(turns 2+: {r['warm_ttft_p90'] * 1e3:.1f} ms), "
            f"goodput {r['goodput']:.2f} req/s"
        )
    baseline = results["round-robin"]
    for policy in policies:
        if policy == "round-robin":
            continue
        r = results[policy]
        print(
            f"{policy:>13} / round-robin: hit rate {r['hit_rate'] / max(baseline['hit_rate'], 1e-9):.2f}x "
            f"(aim >= 2), TTFT p90 {r['ttft_p90'] / max(baseline['ttft_p90'], 1e-9):.2f}x (aim <= 0.5; "
            f"turns 2+: {r['warm_ttft_p90'] / max(baseline['warm_ttft_p90'], 1e-9):.2f}x), "
            f"goodput {r['goodput'] / max(baseline['goodput'], 1e-9):.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
