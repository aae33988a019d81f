"""What a P/D request's chunks say of its prefill: the final chunk carries the prefill
worker's report (where TTFT went, its cached tokens); a first chunk that is an empty
abort because the KV never arrived becomes a clear error."""

from __future__ import annotations

import asyncio
import dataclasses

from splitserve.protocol.engine_api import with_prompt_cached_tokens
from splitserve.protocol.errors import APIError
from splitserve.protocol.kv_transfer import chunk_kv_transfer_params, with_kv_transfer_params

PREFILL_REPORT_WAIT_S = 5.0  # decode has its KV: the prefill's answer is on its way


def is_final(chunk: dict) -> bool:
    return any(c.get("finish_reason") is not None for c in chunk.get("choices") or [])


def raise_if_transfer_failed(chunk: dict) -> None:
    """Decode ended a request without output because its KV never arrived (failure policy
    "fail"): a clear error, since nothing was streamed yet."""
    choices = chunk.get("choices") or []
    if (
        not choices
        or choices[0].get("finish_reason") not in ("abort", "error")
        or choices[0].get("token_ids")
    ):
        return
    handoff = chunk_kv_transfer_params(chunk).handoff or {}
    if handoff.get("error"):
        raise APIError(
            502, f"the KV transfer failed and the decode worker's policy is fail: {handoff['error']}"
        )


async def with_prefill_report(chunk: dict, prefill_task: asyncio.Future | None, report: dict) -> dict:
    """`_with_prefill`; a final chunk first waits (briefly) for the prefill's answer, since
    decode can finish a short answer before that answer has been read."""
    final = any(c.get("finish_reason") is not None for c in chunk.get("choices") or [])
    if final and prefill_task is not None and not prefill_task.done():
        await asyncio.wait({prefill_task}, timeout=PREFILL_REPORT_WAIT_S)
    return with_prefill(chunk, report)


def with_prefill(chunk: dict, prefill_report: dict) -> dict:
    """The final chunk also carries what the prefill worker reported (where TTFT went).
    Its usage's cached tokens are the prefill worker's: decode received the rest of the
    prompt's KV, computed for this request by prefill."""
    if prefill_report and any(c.get("finish_reason") is not None for c in chunk.get("choices") or []):
        reported = dataclasses.replace(chunk_kv_transfer_params(chunk), prefill=prefill_report)
        chunk = with_kv_transfer_params(chunk, reported)
        if "cached_tokens" in prefill_report:
            chunk = with_prompt_cached_tokens(chunk, prefill_report["cached_tokens"])
    return chunk
