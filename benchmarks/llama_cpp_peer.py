"""llama.cpp, the peer for one stream on a CPU, run by bench_latency.py's `--peer llama.cpp`
in its own virtual environment (llama-cpp-python built from source as PEERS.md says; never
a dependency of splitserve). Two commands, each printing one JSON object:

    PYTHON llama_cpp_peer.py quantize IN.gguf OUT.gguf bf16
        llama.cpp's own requantizer: the same weights in another file type.
    PYTHON llama_cpp_peer.py decode FILE.gguf --contexts 64 1024 3000 --output-len 64 --repeats 3
        batch-1 decode in process: per repeat a fresh random prompt of each context length
        is evaluated (its time is TTFT without HTTP), then `--output-len` greedy tokens one
        `eval` each; ITL is the median over the repeats of each request's mean step time.
        No HTTP, no server: llama.cpp's bare decode step, a stricter peer than an HTTP server.

Only the standard library, numpy and llama_cpp are imported: this runs under the peer's
interpreter, not splitserve's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

FILE_TYPES = {"bf16": 32, "f16": 1, "q8_0": 7, "q4_1": 3}  # llama_ftype values


def quantize(source: str, target: str, file_type: str) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if status != 0:
        raise SystemExit(f"llama_model_quantize {source} -> {target} ({file_type}) failed: {status}")
    return {"file": target, "bytes": os.path.getsize(target)}


def decode(
    path: str, contexts: list[int], output_len: int, repeats: int, threads: int, seed: int, repack: bool
) -> dict:
    import llama_cpp
    import numpy as np

    if not repack:  # llama.cpp's repacked (AMX, ...) weight buffers off: the plain CPU kernels
        bindings = llama_cpp.llama_cpp  # the module Llama() takes its default parameters from
        defaults = bindings.llama_model_default_params

        def without_extra_buffers():  # type: ignore[no-untyped-def]
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers

    n_ctx = max(contexts) + output_len + 16
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    vocab = llm.n_vocab()
    rng = random.Random(seed)

    def greedy() -> int:
        # only the last token's logits are computed (no logits_all): llama.cpp's own buffer
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

    def one(length: int) -> tuple[float, float]:
        llm.reset()
        prompt = [rng.randrange(10, vocab) for _ in range(length)]
        started = time.perf_counter()
        llm.eval(prompt)
        token = greedy()
        ttft = time.perf_counter() - started
        steps = []
        for _ in range(output_len - 1):
            started = time.perf_counter()
            llm.eval([token])
            token = greedy()
            steps.append(time.perf_counter() - started)
        return ttft, statistics.fmean(steps)

    one(16)  # warm-up
    figures = {}
    for length in contexts:
        runs = [one(length) for _ in range(repeats)]
        figures[str(length)] = {
            "ttft_ms": statistics.median(r[0] for r in runs) * 1e3,
            "itl_ms": statistics.median(r[1] for r in runs) * 1e3,
        }
    return {"version": llama_cpp.__version__, "threads": threads, "repack": repack, "latency": figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    q = commands.add_parser("quantize")
    q.add_argument("source")
    q.add_argument("target")
    q.add_argument("file_type", choices=sorted(FILE_TYPES))
    d = commands.add_parser("decode")
    d.add_argument("model")
    d.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 3000])
    d.add_argument("--output-len", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-repack", action="store_true", help="no repacked weight buffers (use_extra_bufts)")
    args = parser.parse_args()
    if args.command == "quantize":
        result = quantize(args.source, args.target, args.file_type)
    else:
        result = decode(
            args.model,
            args.contexts,
            args.output_len,
            args.repeats,
            args.threads,
            args.seed,
            not args.no_repack,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
