"""Shared helpers for engine tests: prompts and the transformers oracle."""

from __future__ import annotations

import random

import torch


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, some sharing prefixes and one repeated, so that a
    batch exercises prefix-cache hits as well as misses."""
    rng = random.Random(seed)
    base = [rng.randrange(10, vocab) for _ in range(48)]
    other = [rng.randrange(10, vocab) for _ in range(70)]
    return [
        other[:5],
        base[:40] + [rng.randrange(10, vocab) for _ in range(9)],  # shares 2 full blocks
        other[:70],
        base[:33],
        base[:48],  # exactly 3 blocks
        [rng.randrange(10, vocab)],
        base[:48],  # repeated
        other[:17],
    ]


def oracle_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding), no early stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compared against ignore_eos runs
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(ids[0, len(prompt) :].tolist())
            assert len(outputs[-1]) == max_new_tokens
    return outputs


def oracle_log_softmax(model_dir: str, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [len(generated), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + len(generated)], dim=-1)
