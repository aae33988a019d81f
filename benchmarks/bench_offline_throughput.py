"""Offline throughput, nano-vllm style: splitserve's `LLM` vs vLLM-CPU vs transformers.

64 sequences, prompt and output lengths uniform in [32, 256] (seed 0), random prompt
token IDs, ignore_eos, greedy, on the bench model of ../shared/PEERS.md (Qwen3-shaped,
8 layers, hidden 512, bf16, random weights), all three engines in the same run on the
same weights and the same prompt IDs. Output tokens/s = requested output tokens / wall
time of one `generate` call over the whole batch (after a warm-up). transformers runs
padded batches of 16 (left padding) with every row generating its batch's longest
output; only the requested tokens count.

    .venv/bin/python benchmarks/bench_offline_throughput.py [--skip-vllm] [--skip-hf]
        [--profile-decode]

vLLM-CPU runs in its own virtual environment (/work/vllm-peer, see PEERS.md), in a
subprocess. The ratios are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

from bench_model import compute_dtype, cpu_isa_flags, resolve_bench_model

VLLM_PYTHON = "/work/vllm-peer/bin/python"


class Workload(NamedTuple):
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_model_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))


class Result(NamedTuple):
    name: str
    elapsed_s: float
    num_output_tokens: int
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(prompts, output_lens)


# -- splitserve --------------------------------------------------------------------------


def run_splitserve(
    model: Path, workload: Workload, args: argparse.Namespace, name: str = "splitserve", gguf: bool = False
) -> Result:
    from splitserve.engine.llm import LLM
    from splitserve.protocol.sampling_params import SamplingParams

    # The checkpoint is bf16; where this CPU only emulates bf16 matmul, splitserve is told
    # to compute in float32 over the same weights (vLLM-CPU keeps bf16 with its own kernels).
    # A GGUF file runs as a user gets it: its own defaults (quantized weights kept so).
    dtype = None if gguf else compute_dtype()
    print(f"{name} computes in {dtype or 'the GGUF default'}", flush=True)
    llm = LLM(
        str(model),
        **({"dtype": dtype} if dtype else {}),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_mib * 1024 * 1024,
        max_model_len=workload.max_model_len,
    )
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in workload.output_lens]
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    token_ids = [list(_token_ids(o)) for o in outputs]
    result = Result(name, elapsed, sum(len(t) for t in token_ids), token_ids)
    if args.profile_decode:
        profile_decode_step(llm, workload)
    return result


def _token_ids(output: object) -> list[int]:
    if isinstance(output, dict):
        return output["token_ids"]
    return output.token_ids  # type: ignore[attr-defined]


def profile_decode_step(llm: object, workload: Workload) -> None:
    """Prefill the whole batch, then profile one decode step of all 64 sequences."""
    import torch

    from splitserve.protocol.generate_request import GenerateRequest
    from splitserve.protocol.sampling_params import SamplingParams

    engine = llm.engine  # type: ignore[attr-defined]
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(
            GenerateRequest(
                f"profile-{i}", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            )
        )
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # settle into pure decode steps
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - start
    print(f"\n== one decode step of {len(engine.scheduler.running)} sequences: {step_s * 1e3:.1f} ms ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    engine.abort_request([f"profile-{i}" for i in range(len(workload.prompts))])
    engine.step()


# -- transformers --------------------------------------------------------------------------


def run_transformers(model: Path, workload: Workload, batch_size: int) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).eval()
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # ignore_eos
                do_sample=False,
                pad_token_id=pad_id,
            )
        return out[:, width:].tolist()

    generate([[1, 2, 3, 4]], 4)  # warm-up
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        lens = workload.output_lens[i : i + batch_size]
        rows = generate(workload.prompts[i : i + batch_size], max(lens))
        outputs += [row[:n] for row, n in zip(rows, lens, strict=True)]
    elapsed = time.perf_counter() - start
    return Result(f"transformers (batches of {batch_size})", elapsed, sum(len(o) for o in outputs), outputs)


# -- vLLM-CPU ----------------------------------------------------------------------------

_VLLM_SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import time

    if __name__ == "__main__":
        from vllm import LLM, SamplingParams

        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
                  max_model_len=spec["max_model_len"], seed=0)
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
                  for n in spec["output_lens"]]
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        json.dump({"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outputs]},
                  open(sys.argv[2], "w"))
    """
)


def run_vllm(model: Path, workload: Workload, python: str, dtype: str) -> Result:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        script, spec, out = Path(tmp, "run_vllm.py"), Path(tmp, "spec.json"), Path(tmp, "out.json")
        script.write_text(_VLLM_SCRIPT)
        spec.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "dtype": dtype,
                    "max_model_len": workload.max_model_len,
                    "prompts": workload.prompts,
                    "output_lens": workload.output_lens,
                }
            )
        )
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.run(
            [python, str(script), str(spec), str(out)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"vLLM failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        data = json.loads(out.read_text())
    outputs = data["outputs"]
    return Result(f"vLLM-CPU 0.32 ({dtype})", data["elapsed_s"], sum(len(o) for o in outputs), outputs)


# -- report ------------------------------------------------------------------------------


def leading_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean number of leading output tokens on which two engines agree (bf16 drifts)."""
    total = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        total += n
    return total / len(a)


def report(result: Result) -> None:
    print(
        f"{result.name:<28} {result.tokens_per_s:8.1f} output tok/s  ({result.elapsed_s:.2f} s)", flush=True
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="bench, smollm2 (its shape), or a model directory")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-mib", type=int, default=1024)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm-python", default=VLLM_PYTHON)
    parser.add_argument(
        "--vllm-dtype", action="append", choices=["bfloat16", "float32"],
        help="dtype(s) vLLM runs in (repeatable; default bfloat16, as PEERS.md)",
    )  # fmt: skip
    parser.add_argument("--profile-decode", action="store_true", help="profile one splitserve decode step")
    parser.add_argument(
        "--gguf", default=None, metavar="FILE",
        help="also splitserve on this GGUF file of the same model, served by default ('demo': the demo Q4_1)",
    )  # fmt: skip
    args = parser.parse_args()

    model = resolve_bench_model(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    workload = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    print(
        f"model {model}; {args.num_seqs} sequences, prompts {sum(map(len, workload.prompts))} tokens, "
        f"outputs {workload.num_output_tokens} tokens (lengths uniform in [{args.min_len}, {args.max_len}], "
        f"seed {args.seed}); greedy, ignore_eos; {os.cpu_count()} CPUs; ISA {cpu_isa_flags()}",
        flush=True,
    )

    results = [run_splitserve(model, workload, args)]
    report(results[-1])
    if args.gguf:
        from splitserve.model_files.demo import ensure_demo_model

        gguf = ensure_demo_model() if args.gguf == "demo" else Path(args.gguf)
        beside = run_splitserve(gguf, workload, args, name=f"splitserve {gguf.name}", gguf=True)
        report(beside)
    if not args.skip_hf:
        results.append(run_transformers(model, workload, args.hf_batch_size))
        report(results[-1])
    if not args.skip_vllm:
        for dtype in args.vllm_dtype or ["bfloat16"]:
            results.append(run_vllm(model, workload, args.vllm_python, dtype))
            report(results[-1])
    ours = results[0]

    assert all(len(o) == n for o, n in zip(ours.outputs, workload.output_lens, strict=True)), "wrong lengths"
    for peer in results[1:]:
        agree = leading_agreement(ours.outputs, peer.outputs)
        print(f"greedy agreement with {peer.name}: {agree:.1f} leading tokens per sequence on average")
    print()
    if args.gguf:
        print(
            f"greedy agreement of {beside.name} with splitserve: "
            f"{leading_agreement(beside.outputs, ours.outputs):.1f} leading tokens per sequence on average"
        )
        for peer in results[1:]:
            print(f"ratio {beside.name} / {peer.name}: {beside.tokens_per_s / peer.tokens_per_s:.2f}x")
    for peer in results[1:]:
        print(f"ratio splitserve / {peer.name}: {ours.tokens_per_s / peer.tokens_per_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
