"""Batch-1 ITL of a GGUF file in the engine (offline `LLM`, no HTTP), served three ways:
its own quantized blocks (`quantization="gguf"`, activations float32), dequantized to
bf16, dequantized to float32; with the bytes of weights and KV one decode step reads.

ITL per context length: the median duration of `LLMEngine.step` over the decode steps of
`--repeats` requests of `--output-len` tokens, each with a fresh random prompt of that
length (the first step, the prefill, left out). Only the engine's step is measured:
bench_latency.py adds the HTTP path.

    .venv/bin/python benchmarks/bench_gguf_itl.py [FILE.gguf] [--contexts 64 1024]
        [--settings "bf16 dequantized"]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_model import cpu_isa_flags

from splitserve.engine.llm import LLM
from splitserve.model.linear import Linear
from splitserve.model.quant_linear import QuantLinear
from splitserve.model_files.demo import ensure_demo_model
from splitserve.protocol.sampling_params import SamplingParams

SETTINGS = {
    "gguf (Q4_1 blocks)": {"quantization": "gguf"},
    "gguf, float16 KV cache": {"quantization": "gguf", "kv_cache_dtype": "float16"},
    "bf16 dequantized": {"quantization": "none", "dtype": "bfloat16"},
    "float32 dequantized": {"quantization": "none", "dtype": "float32"},
}


def weight_bytes_per_step(llm: LLM) -> int:
    """Bytes of matmul weights a decode step reads (each Linear's weight or blocks, once)."""
    total, seen = 0, set()
    for module in llm.engine.model.modules():
        if isinstance(module, QuantLinear):
            total += module.blocks.numel()
        elif isinstance(module, Linear):
            weight = module.packed_weight if module.packed_weight is not None else module.weight
            if id(weight) not in seen:
                seen.add(id(weight))
                total += weight.numel() * weight.element_size()
    return total


def kv_bytes_per_token(llm: LLM) -> int:
    cache = llm.engine.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return cache[:, :, 0, 0].numel() * cache.element_size()


def decode_step_times(llm: LLM, prompt: list[int], tokens: int) -> list[float]:
    """The durations of the engine steps after the prefill, for one greedy request."""
    engine, durations = llm.engine, []
    step = engine.step

    def timed_step() -> list:
        started = time.perf_counter()
        outputs = step()
        durations.append(time.perf_counter() - started)
        return outputs

    engine.step = timed_step  # type: ignore[method-assign]
    try:
        llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    finally:
        del engine.step
    return durations[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None, help="a GGUF file (default: the demo model)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="which ways to serve it"
    )
    args = parser.parse_args()
    path = args.model or str(ensure_demo_model())
    print(f"model {path}; ISA {cpu_isa_flags()}; {torch.get_num_threads()} threads", flush=True)
    rng = random.Random(0)
    for name in args.settings:
        settings = SETTINGS[name]
        llm = LLM(
            path,
            num_blocks=(max(args.contexts) + args.output_len) // 16 + 8,
            enable_prefix_caching=False,
            **settings,
        )
        vocab = llm.engine.model_info.vocab_size
        weights, kv = weight_bytes_per_step(llm), kv_bytes_per_token(llm)
        decode_step_times(llm, [rng.randrange(vocab) for _ in range(16)], 4)  # warm-up
        figures = []
        for context in args.contexts:
            samples = []
            for _ in range(args.repeats):
                prompt = [rng.randrange(vocab) for _ in range(context)]
                samples += [t * 1e3 for t in decode_step_times(llm, prompt, 1 + args.output_len)]
            read = (weights + kv * context) / 1e6
            figures.append(
                f"ctx {context}: ITL {statistics.median(samples):.1f} ms, {read:.0f} MB read/token"
            )
        print(
            f"{name:22s} dtype {llm.engine.dtype}; weights {weights / 1e6:.0f} MB; " + "; ".join(figures),
            flush=True,
        )
        del llm


if __name__ == "__main__":
    main()
