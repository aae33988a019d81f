"""The six-turn table, live on the CPU: one conversation (a long system prompt, then user
turns that each append to it), TTFT and prompt tokens computed per turn, for `serve`
(collocated, prefix cache) and `up` (one-way P/D: a prefill and a decode engine).

Computed tokens = prompt tokens - `usage.prompt_tokens_details.cached_tokens`. In one-way
P/D the prefill worker never saw the previous answers (decode generated them), so each
turn recomputes them; a decode-held prefix with a short new turn skips prefill.

    .venv/bin/python benchmarks/bench_multiturn.py [--turns 6] [--answer-tokens 48]

The ratio (P/D computed tokens / collocated computed tokens over turns 2..N) is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import httpx
from bench_kv_routing import text, turn
from bench_pd_streaming import tiny_model
from bench_render import free_port, served


async def conversation(base: str, turns: int, answer_tokens: int) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, cached tokens) per turn."""
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You are a careful assistant. " + text(rng, 150)}]
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(turns):
            messages.append({"role": "user", "content": text(rng, 40)})
            ttft, prompt, cached, answer = await turn(client, base, messages, answer_tokens)
            messages.append({"role": "assistant", "content": answer or "ok"})
            rows.append((ttft, prompt, cached))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=48)
    args = parser.parse_args()
    model = tiny_model(args.model)
    stacks = {
        "collocated": ["serve", model],
        "one-way P/D": ["up", model, "--prefill", "1", "--decode", "1", "--min-prefill-tokens", "16"],
    }
    computed = {}
    for name, command in stacks.items():
        port = free_port()
        with served(
            [sys.executable, "-m", "splitserve.cli", *command, "--port", str(port)], port, command[0]
        ) as base:
            rows = asyncio.run(conversation(base, args.turns, args.answer_tokens))
        print(f"{name}:  turn  TTFT ms  prompt  cached  computed")
        for index, (ttft, prompt, cached) in enumerate(rows, start=1):
            pad = " " * (len(name) + 2)
            print(f"{pad}{index:>5}  {ttft * 1e3:7.1f}  {prompt:6d}  {cached:6d}  {prompt - cached:8d}")
        computed[name] = sum(prompt - cached for _ttft, prompt, cached in rows[1:])
    ratio = computed["one-way P/D"] / max(computed["collocated"], 1)
    print(f"computed prompt tokens, turns 2..{args.turns} (one-way P/D / collocated): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
