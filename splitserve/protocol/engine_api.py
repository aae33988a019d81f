"""The engine API's response side, shared by every tier (the request is
`protocol/generate_request.py`'s): `/inference/v1/generate` chunks
(SSE `data:` events of `{request_id, choices: [{index, token_ids, finish_reason,
stop_reason, logprobs?}], usage?, prompt_token_ids?, kv_transfer_params?, metrics?}`,
vLLM's field names) and the non-streaming response they merge into."""

from __future__ import annotations

from typing import Any


def merge_chunks(chunks: list[dict]) -> dict:
    """Join a request's stream chunks into the non-streaming response shape."""
    if not chunks:
        raise ValueError("no chunks to merge")
    last = chunks[-1]
    token_ids: list[int] = []
    content: list[dict] | None = None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            token_ids.extend(choice.get("token_ids") or [])
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                content = (content or []) + list(logprobs.get("content") or [])
    final_choice = next((c for c in reversed([c for ch in chunks for c in ch.get("choices") or []])), {})
    choice: dict[str, Any] = {
        "index": 0,
        "token_ids": token_ids,
        "finish_reason": final_choice.get("finish_reason"),
        "stop_reason": final_choice.get("stop_reason"),
        "logprobs": {"content": content} if content is not None else None,
    }
    response: dict[str, Any] = {"request_id": last.get("request_id"), "choices": [choice]}
    for name in ("prompt_token_ids",):
        for chunk in chunks:
            if name in chunk:
                response[name] = chunk[name]
    response["usage"] = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    response["kv_transfer_params"] = last.get("kv_transfer_params")
    response["metrics"] = last.get("metrics")
    return response


def prompt_cached_tokens(chunk: dict) -> int | None:
    """The prompt tokens the engine did not compute for this request (its final chunk's
    `usage.prompt_tokens_details.cached_tokens`), None when the chunk does not say."""
    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


def with_prompt_cached_tokens(chunk: dict, cached_tokens: int) -> dict:
    """The chunk with its usage reporting `cached_tokens` (a chunk without usage as is)."""
    usage = chunk.get("usage")
    if not usage:
        return chunk
    details = {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": cached_tokens}
    return {**chunk, "usage": {**usage, "cached_tokens": cached_tokens, "prompt_tokens_details": details}}


def choice_logprobs(choice: dict[str, Any]) -> list[dict] | None:
    """A generate choice's logprob entries (`logprobs.content`), or None when not asked."""
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return None
    return list(logprobs.get("content") or []) if isinstance(logprobs, dict) else list(logprobs)
