"""The `/inference/v1/generate` response side: engine outputs -> wire chunks (vLLM's
field names). The request is `protocol/generate_request.py`'s, parsed at the edge."""

from __future__ import annotations

from typing import Any

from splitserve.engine.outputs import RequestOutput
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import KV_TRANSFER_PARAMS
from splitserve.protocol.openai_chunks import usage_dict


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None) -> dict:
    """vLLM's UsageInfo, with the cached count both where OpenAI puts it
    (`prompt_tokens_details.cached_tokens`) and flat (`cached_tokens`)."""
    result: dict[str, Any] = usage_dict(num_prompt_tokens, num_completion_tokens)
    if num_cached_tokens is not None:
        result["cached_tokens"] = num_cached_tokens
        result["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return result


PROMPT_SOURCES = (
    "prompt_tokens_reused",
    "prompt_tokens_pulled",
    "prompt_tokens_received",
    "prompt_tokens_computed",
)


def prompt_sources(times: dict | None, num_prompt_tokens: int) -> dict[str, int | None]:
    """Where this request's prompt KV came from: reused from the local prefix cache (by
    block hash), pulled from the prefix a decode worker held (prefill in bidirectional P/D,
    also by block hash), received from another worker that computed it for this request,
    or computed here; and the first block neither reused nor pulled (where reuse stopped).
    None before the request was scheduled."""
    times = times or {}
    local, received = times.get("prefix_hit_tokens"), times.get("received_tokens")
    if local is None or received is None:
        return dict.fromkeys((*PROMPT_SOURCES, "prompt_reuse_stopped_block"))
    pulled = int(times.get("pulled_tokens") or 0)
    block_size = int(times.get("block_size") or 1)
    return {
        "prompt_tokens_reused": int(local),
        "prompt_tokens_pulled": pulled,
        "prompt_tokens_received": max(int(received) - pulled, 0),
        "prompt_tokens_computed": max(num_prompt_tokens - int(local) - int(received), 0),
        "prompt_reuse_stopped_block": (int(local) + pulled) // block_size,
    }


def request_metrics(times: dict | None, num_output_tokens: int) -> dict:
    """vLLM's PerRequestMetrics from the engine's timestamps (seconds, one clock)."""
    times = times or {}
    arrival = times.get("arrival_time")
    scheduled = times.get("first_scheduled_time")
    first = times.get("first_token_time")
    last = times.get("last_token_time")
    result: dict[str, float | None] = {
        "time_to_first_token_ms": None,
        "generation_time_ms": None,
        "queue_time_ms": None,
        "mean_itl_ms": None,
        "tokens_per_second": None,
    }
    if arrival is not None and scheduled is not None:
        result["queue_time_ms"] = (scheduled - arrival) * 1e3
    if arrival is not None and first is not None:
        result["time_to_first_token_ms"] = (first - arrival) * 1e3
    if first is not None and last is not None:
        result["generation_time_ms"] = (last - first) * 1e3
        if num_output_tokens > 1 and last > first:
            result["mean_itl_ms"] = (last - first) * 1e3 / (num_output_tokens - 1)
            result["tokens_per_second"] = (num_output_tokens - 1) / (last - first)
    return result


def _logprobs(entries: list[dict]) -> dict:
    """vLLM's GenerateLogProbs: the sampled token first, then its top candidates."""
    content = []
    for entry in entries:
        top = [
            {"token_id": int(token_id), "logprob": float(logprob), "rank": rank}
            for rank, (token_id, logprob) in enumerate(entry.get("top_logprobs") or [], start=1)
        ]
        content.append(
            {"token_id": int(entry["token_id"]), "logprob": float(entry["logprob"]), "top_logprobs": top}
        )
    return {"content": content}


def stop_reason(request: GenerateRequest, output: RequestOutput) -> int | None:
    """vLLM's stop_reason: the stop token that ended generation; None on EOS/length/abort."""
    if output.finish_reason == "stop" and output.new_token_ids:
        last = output.new_token_ids[-1]
        if last in request.sampling_params.stop_token_ids:
            return int(last)
    return None


class ChunkBuilder:
    """Turns one request's engine outputs into stream chunks (delta token IDs)."""

    def __init__(self, request: GenerateRequest):
        self.request = request
        self.num_prompt_tokens = len(request.token_ids)
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None
        self._sent_prompt_ids = False

    def chunk(self, output: RequestOutput, *, force_usage: bool = False) -> dict:
        self.num_output_tokens += len(output.new_token_ids)
        self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        finished = output.finished
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": [int(t) for t in output.new_token_ids],
            "finish_reason": output.finish_reason if finished else None,
            "stop_reason": stop_reason(self.request, output) if finished else None,
        }
        if self.request.sampling_params.logprobs is not None:
            choice["logprobs"] = _logprobs(output.new_logprobs or [])
        chunk: dict[str, Any] = {"request_id": self.request.request_id, "choices": [choice]}
        if self.request.return_token_ids and not self._sent_prompt_ids:
            chunk["prompt_token_ids"] = self.request.token_ids
            self._sent_prompt_ids = True
        wants_usage = force_usage or self.request.include_usage
        if self.request.continuous_usage or (finished and wants_usage):
            chunk["usage"] = usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)
        if finished:
            chunk[KV_TRANSFER_PARAMS] = output.kv_transfer_params
            chunk["metrics"] = request_metrics(output.metrics, self.num_output_tokens)
            chunk["metrics"].update(prompt_sources(output.metrics, self.num_prompt_tokens))
        return chunk
