"""Prefill side, push mode: what a finished prefill request reports (in its
kv_transfer_params) and whether its blocks stay allocated, from the layer pusher's outcome.
"""

from __future__ import annotations

from splitserve.kv.connector.base import ConnectorRequest
from splitserve.kv.connector.handoff_metrics import HandoffMetrics
from splitserve.kv.connector.layer_push import LayerPusher
from splitserve.protocol.kv_transfer import KVTransferParams


def push_finished(
    pusher: LayerPusher,
    metrics: HandoffMetrics,
    request: ConnectorRequest,
    block_ids: list[int],
    sources: dict,
    done_at: float,
) -> tuple[bool, KVTransferParams]:
    """(keep the blocks, the report without this worker's address). A prefill that finished
    before decode said where its KV goes is parked for the target (blocks kept); else the
    pushes are awaited and counted."""
    if pusher.park(request.request_id, request.finish_reason, block_ids):
        parked = KVTransferParams(
            transfer_mode="push", push_target_pending=True, prefill_done_at=done_at, prompt_sources=sources
        )
        return True, parked
    outcome = pusher.finish(request.request_id, request.finish_reason)
    if outcome is None:
        return False, KVTransferParams(transfer_mode="push", kv_transfer_error="no usable push target")
    if outcome.error is not None:
        metrics.failures.labels("prefill").inc()
        metrics.transfers.labels("prefill", "failed").inc()
    else:
        metrics.transfers.labels("prefill", "ok").inc()
        metrics.send_time.observe(outcome.send_s)
    metrics.bytes.labels("sent").inc(outcome.num_bytes)
    metrics.state_bytes.labels("sent").inc(outcome.state_bytes)
    pushed = KVTransferParams(
        transfer_mode="push",
        prefill_done_at=done_at,
        kv_bytes=outcome.num_bytes,
        state_bytes=outcome.state_bytes or None,
        send_s=outcome.send_s,
        kv_transfer_error=outcome.error,
        prompt_sources=sources,
    )
    return False, pushed
