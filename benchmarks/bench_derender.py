"""Streaming derender with the reasoning and tool-call parsers: splitserve vs vLLM's render tier.

One token per call to `POST /v1/chat/completions/derender` (`stream: true`), carrying the
`stream_state` the previous call returned, for an answer of up to 4,000 tokens: ~1,000
tokens of `<think>` reasoning, a line of content, then a `<tool_call>` whose arguments run
to the end. Both servers get the same bodies (generate chunk, chat request with tools,
prompt token IDs). Reported: per-call time (mean of the 10 calls ending there) and
stream_state size (JSON bytes) at tokens 100, 1,000, 2,000, 4,000, and the total time.
vLLM replays the whole history on every call, so it is capped (default 2,000 tokens).

    .venv/bin/python benchmarks/bench_derender.py [--model DIR] [--tokens 4000] [--vllm-tokens 2000]
        [--skip-vllm]

The ratio (vLLM total / splitserve total over the first --vllm-tokens tokens) is printed last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import httpx
from bench_render import WORDS, ensure_model, free_port, splitserve_render, vllm_render

from splitserve.frontend.tokenizer import Tokenizer

CHECKPOINTS = (100, 1000, 2000, 4000)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_report",
            "parameters": {
                "type": "object",
                "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
            },
        },
    }
]


def answer_text(rng: random.Random) -> str:
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    return (
        f"<think>\n{words(900)}\n</think>\n\nI will write the report now.\n"
        '<tool_call>\n{"name": "write_report", "arguments": {"title": "Cache study", "body": "'
        f'{words(4000)}"}}}}\n</tool_call>'
    )


def stream_derender(
    base: str, ids: list[int], chat: dict, prompt_ids: list[int]
) -> tuple[list[float], list[int], str]:
    times, sizes, arguments = [], [], ""
    state = None
    with httpx.Client(timeout=120) as client:
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            body = {
                "stream": True,
                "generate_chunk": {
                    "request_id": "bench-derender",
                    "choices": [
                        {"index": 0, "token_ids": [token], "finish_reason": "stop" if last else None}
                    ],
                },
                "stream_state": state,
                "chat_request": chat,
                "prompt_token_ids": prompt_ids,
            }
            start = time.perf_counter()
            response = client.post(base + "/v1/chat/completions/derender", json=body)
            times.append(time.perf_counter() - start)
            response.raise_for_status()
            result = response.json()
            state = result["stream_state"]
            sizes.append(len(json.dumps(state)))
            for choice in result["chunk"]["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    arguments += (call.get("function") or {}).get("arguments") or ""
    return times, sizes, arguments


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--vllm-tokens", type=int, default=2000)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    model = ensure_model(args.model)
    tokenizer = Tokenizer.from_dir(model)
    ids = tokenizer.encode(answer_text(random.Random(0)))[: args.tokens]
    chat = {
        "messages": [{"role": "user", "content": "Write the cache report."}],
        "tools": TOOLS,
        "stream": True,
    }

    results: dict[str, tuple[list[float], list[int], str]] = {}
    with splitserve_render(model, free_port()) as base:
        prompt_ids = httpx.post(base + "/v1/chat/completions/render", json=chat, timeout=60).json()[
            "token_ids"
        ]
        stream_derender(base, ids[:50], chat, prompt_ids)  # warm-up
        results["splitserve"] = stream_derender(base, ids, chat, prompt_ids)
    if not args.skip_vllm:
        with vllm_render(model, free_port()) as base:
            stream_derender(base, ids[:50], chat, prompt_ids)
            results["vllm"] = stream_derender(base, ids[: args.vllm_tokens], chat, prompt_ids)

    print(
        f"\nstreaming derender, one token per call, {len(ids)} tokens"
        " (reasoning, content, one long tool call)"
    )
    print(f"{'token':>6} " + " ".join(f"{name + ' ms/call':>18} {name + ' state B':>18}" for name in results))
    for checkpoint in CHECKPOINTS:
        row = f"{checkpoint:>6} "
        for times, sizes, _ in results.values():
            if checkpoint <= len(times):
                window = times[checkpoint - 10 : checkpoint]
                row += f"{sum(window) / len(window) * 1e3:>18.2f} {sizes[checkpoint - 1]:>18d}"
            else:
                row += f"{'-':>18} {'-':>18}"
        print(row)
    for name, (times, _, arguments) in results.items():
        print(
            f"{name}: total {sum(times):.2f} s for {len(times)} calls;"
            f" streamed arguments {len(arguments)} chars"
        )
    if "vllm" in results:
        n = len(results["vllm"][0])
        ours, theirs = sum(results["splitserve"][0][:n]), sum(results["vllm"][0])
        same = results["splitserve"][2][: len(results["vllm"][2])] == results["vllm"][2]
        print(f"tool-call arguments streamed by both agree over vLLM's {n} tokens: {'yes' if same else 'NO'}")
        print(f"\nratio at {n} tokens (vLLM total / splitserve total): {theirs / ours:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
