"""The P/D break-even, measured and predicted: from which uncached prompt length does a
prompt reach its first token sooner through the prefill worker than on the decode worker
alone, on an idle `up` and on one whose decode worker is streaming?

`splitserve up --prefill 1 --decode 1`, engines pinned one per core (render and proxy
beside prefill, as the headline runs it), started twice: every prompt forced through the
prefill worker (`--pd-decision threshold --min-prefill-tokens 1`), then every prompt kept
on decode (`--min-prefill-tokens` past any prompt). For each, at each load (no stream, and
`--streams` background streams decoding), the median TTFT of `--repeats` streaming
completions per prompt length, each prompt new (no prefix hit). The measured break-even is
where the two TTFT curves cross (linear between the lengths).

Beside it, the cost model the proxy decides with and the simulator applies
(`protocol/pd_decision.py`), fed the costs the forced-remote proxy measured in the same
run (`/workers` `pd_costs`): its pure-TTFT break-even (no charge for the streams a local
prefill stalls, as measured here) and the break-even `--pd-decision cost` acts on (which
charges them).

    .venv/bin/python benchmarks/bench_pd_break_even.py [--model smollm2|bench|DIR] [--streams 4]

The ratio measured / predicted (pure TTFT, idle and loaded) is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import statistics
import sys

import httpx
from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model
from bench_render import free_port, served, stream_openai

from splitserve.protocol.pd_decision import CostModel, break_even_tokens

LENGTHS = (32, 64, 128, 256, 512, 1024, 1536)
PINNED = "prefill=0,decode=1,render=0,proxy=0"


def up_command(model: str, dtype: str, min_prefill_tokens: int) -> list[str]:
    return [
        sys.executable, "-m", "splitserve.cli", "up", model, "--prefill", "1", "--decode", "1",
        "--cpu-affinity", PINNED, "--dtype", dtype, "--max-model-len", "2048",
        "--pd-decision", "threshold", "--min-prefill-tokens", str(min_prefill_tokens),
        "--log-level", "warning",
    ]  # fmt: skip


async def ttft(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int = 1) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    return (await stream_openai(client, f"{base}/v1/completions", body)).ttft


async def background(client: httpx.AsyncClient, base: str, rng: random.Random, stop: asyncio.Event) -> None:
    """One stream decoding on the decode worker until `stop`, a new one after each ends."""
    while not stop.is_set():
        prompt = [rng.randrange(10, 20000) for _ in range(16)]
        await ttft(client, base, prompt, max_tokens=400)


async def sweep(base: str, streams: int, repeats: int, seed: int) -> dict[int, float]:
    """Median TTFT (s) per prompt length with `streams` streams decoding meanwhile."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        await ttft(client, base, [rng.randrange(10, 20000) for _ in range(64)])  # warm-up
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(background(client, base, rng, stop)) for _ in range(streams)]
        try:
            if streams:
                await asyncio.sleep(2.0)  # their prompts done: they decode
            medians = {}
            for length in LENGTHS:
                times = [
                    await ttft(client, base, [rng.randrange(10, 20000) for _ in range(length)])
                    for _ in range(repeats)
                ]
                medians[length] = statistics.median(times)
            return medians
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def crossing(local: dict[int, float], remote: dict[int, float]) -> float:
    """The prompt length where remote's TTFT falls below local's (inf: never; 0: at once)."""
    previous = None
    for length in LENGTHS:
        gap = local[length] - remote[length]  # > 0: remote is faster
        if gap > 0:
            if previous is None:
                return 0.0
            (low, low_gap) = previous
            return low + (length - low) * (-low_gap) / (gap - low_gap)
        previous = (length, gap)
    return math.inf


def measured_costs(base: str) -> CostModel:
    costs = httpx.get(f"{base}/workers", timeout=10).json()["pd_costs"]["costs"]
    return CostModel(**costs)


def tokens(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (the SmolLM2-135M shape), bench, or a DIR"
    )
    parser.add_argument("--streams", type=int, default=4, help="background streams of the loaded sweep")
    parser.add_argument("--repeats", type=int, default=5, help="prompts per length (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, dtype = str(resolve_bench_model(args.model)), compute_dtype()
    print(f"model {model}; ISA {cpu_isa_flags()}; dtype {dtype}; streams {args.streams}", flush=True)
    curves: dict[str, dict[int, dict[int, float]]] = {}
    costs = CostModel()
    for path, threshold in (("remote", 1), ("local", 10**6)):
        port = free_port()
        with served([*up_command(model, dtype, threshold), "--port", str(port)], port, f"up-{path}") as base:
            curves[path] = {
                load: asyncio.run(sweep(base, load, args.repeats, args.seed)) for load in (0, args.streams)
            }
            if path == "remote":
                costs = measured_costs(base)
    print(
        f"{'tokens':>7}  "
        + "  ".join(f"{p} TTFT ms, {s} streams".rjust(26) for s in (0, args.streams) for p in curves)
    )
    for length in LENGTHS:
        cells = [curves[p][s][length] * 1e3 for s in (0, args.streams) for p in curves]
        print(f"{length:>7}  " + "  ".join(f"{c:26.1f}" for c in cells))
    pure = dataclasses.replace(costs, min_charged_streams=0.0, stall_fraction=0.0)
    print(
        f"measured costs: prefill {costs.prefill_s_per_token * 1e6:.0f} us/token, handoff "
        f"{costs.handoff_fixed_s * 1e3:.1f} ms + {costs.handoff_s_per_token * 1e6:.2f} us/token"
    )
    ratios = []
    for load in (0, args.streams):
        measured = crossing(curves["local"][load], curves["remote"][load])
        predicted = break_even_tokens(pure, load)
        decided = break_even_tokens(costs, load)
        print(
            f"{load} streams: measured break-even {tokens(measured)} tokens; cost model, pure TTFT "
            f"{tokens(predicted)}; as --pd-decision cost decides (stalled streams charged) {tokens(decided)}"
        )
        ratios.append(measured / predicted if predicted and not math.isinf(predicted) else math.nan)
    idle, loaded = ratios
    print(f"ratio measured / predicted break-even: idle {idle:.2f}x, {args.streams} streams {loaded:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
