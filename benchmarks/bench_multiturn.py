"""The six-turn table, live on the CPU: one conversation (a long system prompt, then user
turns that each append to the previous prompt and answer), TTFT, prompt tokens computed
and KV blocks pulled per turn,
for `serve` (collocated, prefix cache), `up --no-kv-bidirectional` (one-way P/D: a prefill
and a decode engine) and `up` (bidirectional P/D: prefill pulls, by block hash, the prefix
the decode worker holds, the previous answers included).

The conversation travels as token IDs (`/v1/completions`): the tiny model's answers are
random tokens whose text does not tokenize back to the same IDs, so a chat history would
hide the answer's reuse in every stack alike; reuse depends on the tokens, never on the
API that carried them.

Computed tokens = prompt tokens - `usage.prompt_tokens_details.cached_tokens`. In one-way
P/D the prefill worker never saw the previous answers (decode generated them), so each
turn recomputes them; bidirectional P/D pulls them from decode instead. Blocks pulled are
the prefill engine's `splitserve_kv_prefix_blocks_total{direction="pulled"}` per turn.

    .venv/bin/python benchmarks/bench_multiturn.py [--turns 6] [--answer-tokens 48] [--repeats 3]
    .venv/bin/python benchmarks/bench_multiturn.py --agent --repeats 1   # 40 turns, tool outputs,
                                                                         # reasoning stripped

TTFT is the median over `--repeats` conversations (the machine's noise otherwise decides);
`--model DIR` runs another model (default: the tiny test model). The P/D stacks send
every turn through the prefill worker (`--pd-decision threshold --min-prefill-tokens 16`);
"up (cost decision)" is `up` as it starts by default, each turn's path decided on its
cost (a short new turn stays on the decode worker that holds the conversation).

Ratios last: computed prompt tokens (P/D / collocated) and mean TTFT (P/D / collocated)
over turns 2..N.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from bench_pd_streaming import tiny_model
from bench_render import free_port, served, stream_openai

Row = tuple[float, int, int, int]  # TTFT, prompt tokens, cached tokens, blocks pulled


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(300, 1800) for _ in range(count)]


async def token_turn(
    client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int
) -> tuple[float, int, list[int]]:
    """(TTFT, cached tokens, answer token IDs) of one streaming completion turn."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ttft, choices, usage = await stream_openai(client, f"{base}/v1/completions", body)
    answer = [token for choice in choices for token in choice.get("token_ids") or []]
    if len(answer) != usage.get("completion_tokens"):
        # a chunk whose bytes were not yet text streams no event: ask again (greedy: the same
        # answer, and a full prefix hit) for the answer's token IDs
        body = {**body, "stream": False, "stream_options": None}
        answer = (await client.post(f"{base}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, cached, answer


async def conversations(base: str, args: argparse.Namespace, pulled_blocks: Callable[[], float]) -> list[Row]:
    """Per turn: the median TTFT over `repeats` conversations (each its own system prompt,
    one after another), and the first conversation's token and block counts. The first
    `reasoning_tokens` of each answer count as its reasoning, which the next turn's
    history drops (as Qwen3's template does): what decode holds stops matching there."""
    turns, answer_tokens, repeats = args.turns, args.answer_tokens, args.repeats
    runs: list[list[Row]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        warm = random.Random(1)  # unrelated prompts first: the first calls compile kernels
        for length in (250, 120, 60):
            await token_turn(client, base, token_ids(warm, length), 4)
        for repeat in range(repeats):
            rng = random.Random(100 + repeat)
            prompt = token_ids(rng, 200)  # the system prompt
            rows = []
            for _ in range(turns):
                prompt = prompt + token_ids(rng, args.message_tokens)  # a user message or tool output
                before = pulled_blocks()
                ttft, cached, answer = await token_turn(client, base, prompt, answer_tokens)
                rows.append((ttft, len(prompt), cached, int(pulled_blocks() - before)))
                prompt = prompt + answer[args.reasoning_tokens :]
            runs.append(rows)
    return [(statistics.median(run[turn][0] for run in runs), *runs[0][turn][1:]) for turn in range(turns)]


def prefill_pulled_blocks(command_name: str, port: int) -> Callable[[], float]:
    """Reads the prefill engine's pulled-blocks counter: `up` prints its parts' URLs and
    pids; the engine wants the deployment token `up` put in the part's environment."""
    log = Path(tempfile.gettempdir()) / f"bench-{command_name}-{port}.log"
    deadline = time.monotonic() + 60
    while "OpenAI API:" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    url, pid = re.search(r"^\s+prefill-0\s+(http://\S+)\s+\(pid (\d+)\)", log.read_text(), re.M).groups()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    token = next(e.split(b"=", 1)[1] for e in environ if e.startswith(b"SPLITSERVE_INTERNAL_TOKEN="))
    headers = {"Authorization": f"Bearer {token.decode()}"}

    def read() -> float:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
        found = re.search(r'^splitserve_kv_prefix_blocks_total\{direction="pulled"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    return read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="conversations per stack (median TTFT)")
    parser.add_argument("--message-tokens", type=int, default=50, help="each turn's new message")
    parser.add_argument(
        "--reasoning-tokens", type=int, default=0, help="leading answer tokens the next turn's history drops"
    )
    parser.add_argument(
        "--agent",
        action="store_true",
        help="40 agent-like turns (3,750 tokens at the end): 72-token tool outputs, 32-token"
        " answers whose first 16 (reasoning) the next turn drops",
    )
    args = parser.parse_args()
    if args.agent:
        args.turns, args.message_tokens, args.reasoning_tokens, args.answer_tokens = 40, 72, 16, 32
    model = tiny_model(args.model)
    pd = [
        "up",
        model,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--min-prefill-tokens",
        "16",
        "--pd-decision",
        "threshold",
    ]
    stacks = {
        "collocated": ["serve", model],
        "one-way P/D": [*pd, "--no-kv-bidirectional"],
        "bidirectional P/D": pd,
        # what `up` does by default: each turn's path decided on its cost (docs/pd.md)
        "up (cost decision)": pd[:6],
    }
    results: dict[str, list[Row]] = {}
    for name, command in stacks.items():
        port = free_port()
        with served(
            [sys.executable, "-m", "splitserve.cli", *command, "--port", str(port)], port, command[0]
        ) as base:
            pulled = prefill_pulled_blocks(command[0], port) if command[0] == "up" else lambda: 0.0
            results[name] = asyncio.run(conversations(base, args, pulled))
    print("turn  " + "  ".join(f"{name + ' TTFT ms':>24}  computed  pulled" for name in results))
    for index in range(args.turns):
        cells = []
        for rows in results.values():
            ttft, prompt, cached, pulled_blocks = rows[index]
            cells.append(f"{ttft * 1e3:24.1f}  {prompt - cached:8d}  {pulled_blocks:6d}")
        print(f"{index + 1:>4}  " + "  ".join(cells))
    base_rows = results["collocated"][1:]
    for name in ("one-way P/D", "bidirectional P/D", "up (cost decision)"):
        rows = results[name][1:]
        computed = sum(p - c for _t, p, c, _b in rows) / max(sum(p - c for _t, p, c, _b in base_rows), 1)
        ttft = sum(t for t, *_ in rows) / max(sum(t for t, *_ in base_rows), 1e-9)
        worst = max(t / max(b[0], 1e-9) for (t, *_), b in zip(rows, base_rows, strict=True))
        print(
            f"{name} / collocated, turns 2..{args.turns}: computed prompt tokens {computed:.2f}, "
            f"mean TTFT {ttft:.2f}, worst turn TTFT {worst:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
