"""Vectorised sampling: greedy fast path, temperature, top-k, top-p, per-request seeds,
and logprobs of the raw model distribution (before temperature and truncation).

A seeded request's noise at output position p comes from a generator seeded with
(seed, p) alone: its draws do not depend on the batch, and a request resumed at position
k on another worker (migration) draws what the undisturbed run drew there."""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitserve.model.ops import argmax_rows
from splitserve.protocol.sampling_params import SamplingParams


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    # per row: None, or {"token_id", "logprob", "top_logprobs": [[id, lp], ...]}
    logprobs: list[dict | None]


class SeededDraw(NamedTuple):
    seed: int  # the request's
    position: int  # the output position being sampled (0: the first output token)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output `position`: splitmix64 of
    both, so neighbouring positions and seeds give unrelated streams."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # the unseeded requests' shared stream
        self.generator.manual_seed(seed)
        self.seeded_generator = torch.Generator(device=device)  # reseeded for each seeded draw

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V], the model dtype
        params: list[SamplingParams],
        seeded: list[SeededDraw | None],
    ) -> SamplerOutput:
        if all(p.greedy for p in params):
            sampled = argmax_rows(logits)
        else:
            logits = logits.float()
            sampled = self._sample(logits, params, seeded)
        token_ids = sampled.tolist()
        logprobs: list[dict | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
            chosen = log_probs.gather(1, sampled[rows][:, None]).squeeze(1).tolist()
            max_top = max(params[i].logprobs or 0 for i in wanted)
            top_values, top_ids = log_probs.topk(max_top, dim=-1) if max_top else (None, None)
            for j, i in enumerate(wanted):
                n = params[i].logprobs or 0
                top = (
                    [
                        [int(t), float(lp)]
                        for t, lp in zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True)
                    ]
                    if n and top_ids is not None and top_values is not None
                    else []
                )
                logprobs[i] = {"token_id": token_ids[i], "logprob": chosen[j], "top_logprobs": top}
        return SamplerOutput(token_ids, logprobs)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seeded: list[SeededDraw | None]
    ) -> torch.Tensor:
        greedy_rows = torch.tensor([p.greedy for p in params], device=logits.device)
        temperature = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in params], device=logits.device, dtype=logits.dtype
        )
        scaled = logits / temperature[:, None]
        if any(p.uses_top_k and not p.greedy for p in params):
            top_k = torch.tensor(
                [p.top_k if p.uses_top_k else logits.shape[1] for p in params], device=logits.device
            ).clamp(max=logits.shape[1])
            sorted_desc = scaled.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (top_k - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if any(p.top_p < 1.0 and not p.greedy for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
            sorted_logits, order = scaled.sort(dim=-1, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= (1 - top_p)[:, None]
            drop_sorted[:, -1] = False  # always keep the most likely token
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = scaled.softmax(dim=-1)
        # Exponential race (Gumbel-max in disguise): argmax(p / E), E ~ Exp(1). Seeded rows
        # draw their own noise, from (seed, position) alone.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, draw in enumerate(seeded):
            if draw is not None and not params[i].greedy:
                self.seeded_generator.manual_seed(position_seed(draw.seed, draw.position))
                noise[i].exponential_(generator=self.seeded_generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows, argmax_rows(logits), sampled)
