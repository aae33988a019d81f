"""The P/D connector's record of one request waiting for remote KV, and what a finished
decode request reports about its handoff (where the TTFT went)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.kv.connector.handoff_metrics import HandoffMetrics

if TYPE_CHECKING:
    from splitserve.kv.connector.base import ConnectorRequest


def wall_to_monotonic(wall: float) -> float:
    return time.monotonic() - (time.time() - wall)


@dataclass
class Load:
    """One request waiting for remote KV: decode's push or pull, or prefill's prefix pull."""

    transfer_id: str
    mode: str  # "push" | "pull" (decode) | "prefix" (prefill pulls decode's held prefix)
    started: float  # monotonic
    ready_mono: float | None = None  # when prefill's last layer was computed, in our clock
    last_arrival_mono: float | None = None
    noticed_mono: float | None = None  # when the engine picked the finished load up
    transfer_s: float = 0.0
    num_bytes: int = 0
    state_bytes: int = 0  # a hybrid model's Mamba state, apart from the KV
    done: bool = False
    ok: bool = False
    error: str | None = None
    orphaned: bool = False  # the request finished while the transfer was in flight
    num_blocks: int = 0  # prefix pull: blocks read


def handoff_report(load: Load, request: ConnectorRequest, metrics: HandoffMetrics) -> dict:
    """Decode: how the request's KV arrived, and where the TTFT went from the moment
    prefill's last layer was computed: the part of the transfer left exposed, the
    notification, then decode's own first step."""
    handoff: dict = {
        "transferred": load.ok,
        "mode": load.mode,
        "bytes": load.num_bytes,
        "state_bytes": load.state_bytes,
        "wait_s": load.transfer_s,
        "error": load.error,
    }
    first_token = request.metrics.get("first_token_time")
    if load.ok and load.ready_mono is not None and load.last_arrival_mono is not None:
        handoff["exposed_transfer_s"] = max(0.0, load.last_arrival_mono - load.ready_mono)
        if load.noticed_mono is not None:
            handoff["notification_s"] = max(0.0, load.noticed_mono - load.last_arrival_mono)
        if first_token is not None:
            exposed = max(0.0, first_token - load.ready_mono)
            handoff["exposed_handoff_s"] = exposed
            metrics.exposed_handoff.observe(exposed)
    return handoff
