"""Request migration: a generate request whose decode worker died or stalled mid-stream
resumes on another decode worker from the prompt plus the tokens already streamed (the
proxy holds both as token IDs), asking only for the tokens still owed. The client sees
one stream; greedy output equals an uninterrupted run. A seeded sampled request does too:
the resumed request says how many output tokens precede it
(`sampling_params.preceding_output_tokens`), and the engine draws a seeded request's
noise from (seed, output position), so it samples what the undisturbed run samples.

A multimodal request resumes the same way: its features' placements index into the original
prompt, which leads the resumed one unchanged; the images travel without pixels when the
encoder pool had them encoded (the engines load the embeddings by hash from the encoder
cache), and the M-RoPE positions of the streamed tokens, now prompt tokens after the last
image, are those decode gave them (index + the prompt's rope delta).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import chunk_kv_transfer_params


class StreamedSoFar:
    """What one single-choice generate request has streamed to the client."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.finished = False

    def add(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            self.token_ids += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                self.finished = True


def placeholder_tokens(features: Any, prompt: list[Any]) -> set[Any]:
    """The prompt's image placeholder tokens: those at the offset of each image's placement."""
    if not isinstance(features, dict):
        return set()
    placements = (features.get("mm_placeholders") or {}).get("image") or []
    offsets = [p.get("offset") for p in placements if isinstance(p, dict)]
    return {prompt[o] for o in offsets if isinstance(o, int) and 0 <= o < len(prompt)}


def resumed_request(request: GenerateRequest, streamed: list[int]) -> GenerateRequest | None:
    """The request that continues `request` after `streamed`; None when nothing is owed or
    the request cannot be continued this way. (vLLM's `min_tokens` needs no adjusting: a
    request reaches the router only with its neutral value.)"""
    if set(streamed) & placeholder_tokens(request.features, list(request.token_ids)):
        return None  # an image token after the prompt would read as an image the features lack
    sampling = request.sampling_params
    max_tokens = sampling.max_tokens  # None: what the context leaves, for the engine to say
    if max_tokens is not None:
        if max_tokens - len(streamed) <= 0:
            return None
        max_tokens -= len(streamed)
    preceding = sampling.preceding_output_tokens
    if sampling.seed is not None:  # only seeded requests: vLLM has no such field
        preceding += len(streamed)
    return dataclasses.replace(
        request,
        token_ids=(*request.token_ids, *streamed),
        sampling_params=dataclasses.replace(
            sampling, max_tokens=max_tokens, preceding_output_tokens=preceding
        ),
        kv_transfer_params=None,
    )


def resumed_prompt_sources(final: dict[str, Any]) -> dict[str, int] | None:
    """Where the KV of a request's prompt came from across the workers that served it, from
    its final chunk: decode's own sources (`metrics.prompt_tokens_*`) with the part decode
    received told by the prefill worker's (`kv_transfer_params.prefill`): what prefill found
    in its prefix cache counts as reused, what it pulled by block hash as pulled, the rest as
    computed. `reused + pulled + computed` = the prompt; None without decode's sources."""
    metrics = final.get("metrics") or {}
    counts = [metrics.get(f"prompt_tokens_{name}") for name in ("reused", "pulled", "received", "computed")]
    if not all(isinstance(count, int) for count in counts):
        return None
    reused, pulled, received, computed = counts
    held = reused + pulled  # decode's own prefix: what it received starts after it
    prefill = chunk_kv_transfer_params(final).prefill or {}
    sources = prefill.get("prompt_sources") or {}
    prefill_pulled = int(sources.get("pulled_tokens") or 0)
    prefill_reused = sources.get("reused_tokens")
    if not isinstance(prefill_reused, int):  # pull mode reports only prefill's cached tokens
        prefill_reused = max(0, int(prefill.get("cached_tokens") or 0) - prefill_pulled)
    end = held + received
    reused_there = max(0, min(end, prefill_reused) - held)
    pulled_there = max(0, min(end, prefill_reused + prefill_pulled) - max(held, prefill_reused))
    return {
        "prompt_tokens_reused": reused + reused_there,
        "prompt_tokens_pulled": pulled + pulled_there,
        "prompt_tokens_computed": computed + received - reused_there - pulled_there,
    }


def as_original(chunk: dict[str, Any], request: GenerateRequest, streamed_before: int) -> dict[str, Any]:
    """A chunk of the resumed request, told as the original request: the streamed tokens
    count as output, not prompt. The final chunk's `metrics.resumed` tells the resumed
    request's prompt (`prompt_tokens` = the original prompt + `streamed_tokens`) and where
    its KV came from (`resumed_prompt_sources`)."""
    if not streamed_before:
        return chunk
    chunk = dict(chunk)
    sources = resumed_prompt_sources(chunk)
    if sources is not None and any(c.get("finish_reason") is not None for c in chunk.get("choices") or []):
        prompt_tokens = sum(sources.values())
        resumed = {"prompt_tokens": prompt_tokens, "streamed_tokens": streamed_before, **sources}
        chunk["metrics"] = {**chunk["metrics"], "resumed": resumed}
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        chunk["usage"] = {
            **usage,
            "prompt_tokens": usage["prompt_tokens"] - streamed_before,
            "completion_tokens": int(usage.get("completion_tokens") or 0) + streamed_before,
        }
    if isinstance(chunk.get("prompt_token_ids"), list):
        chunk["prompt_token_ids"] = list(request.token_ids)
    return chunk
