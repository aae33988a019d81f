"""`--kv-cache-dtype`: a 16-bit KV cache under float32 activations, through LLM(...) and the
engine's flags; the cache's dtype sizes the pool from the budget."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys

import pytest
import torch

from splitserve.config import CacheConfig
from splitserve.engine.llm import LLM
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.test_engine_config import parse

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    # within one block, across blocks, and past decode attention's 256-token partitions
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 37, 100, 260)]


@pytest.fixture(scope="module")
def float32_run(tiny_model) -> list:
    llm = LLM(tiny_model, dtype="float32", num_blocks=64)
    assert llm.engine.kv_cache.dtype == torch.float32  # auto: the compute dtype
    return llm.generate(prompts(), GREEDY)


# measured on the tiny float32 model, 4 prompts x 32 greedy tokens: every token the same,
# the sampled tokens' logprobs at most 9.2e-3 (bf16) and 1.0e-3 (fp16) from a float32
# cache's (fp16's 3 more mantissa bits: ~8x closer); bounds ~3x that
LOGPROB_BOUND = {"bfloat16": 3e-2, "float16": 3e-3}


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_under_float32_activations_generates_as_a_float32_cache(
    tiny_model, float32_run, cache_dtype
):
    llm = LLM(tiny_model, dtype="float32", kv_cache_dtype=cache_dtype, num_blocks=64)
    assert llm.engine.dtype == torch.float32
    assert llm.engine.kv_cache.dtype == getattr(torch, cache_dtype)
    assert llm.engine.model_info.kv_cache_dtype == cache_dtype
    ours = llm.generate(prompts(), GREEDY)
    worst = 0.0
    for mine, reference in zip(ours, float32_run, strict=True):
        assert mine.token_ids == reference.token_ids
        for a, b in zip(mine.logprobs, reference.logprobs, strict=True):
            worst = max(worst, abs(a["logprob"] - b["logprob"]))
    assert 0.0 < worst < LOGPROB_BOUND[cache_dtype], worst


def test_the_budget_holds_twice_the_blocks_of_a_16_bit_cache(tiny_model):
    budget = 4 * 1024 * 1024
    wide = LLM(tiny_model, dtype="float32", kv_cache_memory_bytes=budget)
    narrow = LLM(tiny_model, dtype="float32", kv_cache_dtype="float16", kv_cache_memory_bytes=budget)
    assert narrow.engine.block_manager.num_blocks == 2 * wide.engine.block_manager.num_blocks
    assert narrow.engine.kv_cache.nbytes <= budget


def test_a_cache_other_than_the_compute_dtype_or_16_bit_under_float32_is_refused(tiny_model):
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 under bfloat16 activations"):
        LLM(tiny_model, dtype="bfloat16", kv_cache_dtype="float32", num_blocks=8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        CacheConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]


def test_the_flag_reaches_the_engine_config_and_a_bad_value_exits_with_its_choices():
    from splitserve.engine.api import cli as engine_cli

    assert engine_cli.engine_config(parse(), "/m").cache.kv_cache_dtype == "auto"
    config = engine_cli.engine_config(parse("--kv-cache-dtype", "float16"), "/m")
    assert config.cache.kv_cache_dtype == "float16"
    from splitserve.deploy import up_cli
    from splitserve.deploy.plan import engine_flags

    up_parser = argparse.ArgumentParser()
    up_cli.add_arguments(up_parser)
    flags = engine_flags(up_parser.parse_args(["--kv-cache-dtype", "bfloat16"]))
    assert "--kv-cache-dtype" in flags and flags[flags.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert "--kv-cache-dtype" not in engine_flags(up_parser.parse_args([]))  # the engines' own default
    for command in ("serve", "engine", "up"):
        done = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", command, "--kv-cache-dtype", "fp8"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, (command, done.stderr)
        assert "--kv-cache-dtype: invalid choice: 'fp8'" in done.stderr, done.stderr
        assert "'auto', 'float32', 'bfloat16', 'float16'" in done.stderr
