"""Request migration: a generate request whose decode worker died or stalled mid-stream
resumes on another decode worker from the prompt plus the tokens already streamed (the
proxy holds both as token IDs), asking only for the tokens still owed. The client sees
one stream; greedy output equals an uninterrupted run. A seeded sampled request does too:
the resumed request says how many output tokens precede it
(`sampling_params.preceding_output_tokens`), and the engine draws a seeded request's
noise from (seed, output position), so it samples what the undisturbed run samples.
"""

from __future__ import annotations

from typing import Any

from splitserve.protocol.engine_api import PRECEDING_OUTPUT_TOKENS


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


def resumed_request(request: dict[str, Any], streamed: list[int]) -> dict[str, Any] | None:
    """The request that continues `request` after `streamed`; None when nothing is owed or
    the request cannot be continued this way."""
    prompt = request.get("token_ids")
    sampling = dict(request.get("sampling_params") or {})
    if not isinstance(prompt, list) or request.get("features"):
        return None  # multimodal prompts carry placements into the prompt: not resumable here
    max_tokens = sampling.get("max_tokens")
    if isinstance(max_tokens, int):
        if max_tokens - len(streamed) <= 0:
            return None
        sampling["max_tokens"] = max_tokens - len(streamed)
    min_tokens = sampling.get("min_tokens")
    if isinstance(min_tokens, int):
        sampling["min_tokens"] = max(0, min_tokens - len(streamed))
    if sampling.get("seed") is not None:  # only seeded requests: vLLM has no such field
        preceding = sampling.get(PRECEDING_OUTPUT_TOKENS)
        sampling[PRECEDING_OUTPUT_TOKENS] = (preceding if isinstance(preceding, int) else 0) + len(streamed)
    resumed = {**request, "token_ids": [*prompt, *streamed], "sampling_params": sampling}
    resumed.pop("kv_transfer_params", None)
    return resumed


def as_original(chunk: dict[str, Any], request: dict[str, Any], streamed_before: int) -> dict[str, Any]:
    """A chunk of the resumed request, told as the original request: the streamed tokens
    count as output, not prompt."""
    if not streamed_before:
        return chunk
    chunk = dict(chunk)
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        chunk["usage"] = {
            **usage,
            "prompt_tokens": usage["prompt_tokens"] - streamed_before,
            "completion_tokens": int(usage.get("completion_tokens") or 0) + streamed_before,
        }
    if isinstance(chunk.get("prompt_token_ids"), list):
        chunk["prompt_token_ids"] = request.get("token_ids")
    return chunk
