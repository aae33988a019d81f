"""Where one attempt of a P/D request spent its time before its first token.

The proxy marks what it sees on its own clock (the attempt started, its first engine
request was sent, decode's reservation came back, the first token arrived); the engines
measure the rest on theirs (the prefilling engine's queue and compute, from its final
chunk's `metrics`; decode's handoff report: the exposed transfer, the notification and
its first step). `AttemptClock.phases` lays them end to end within the proxy's interval
(`protocol/timeline.partition`), so they never sum to more than it; the rest is `hops`
(the HTTP hops between the parts, and what no one measured). The decode worker's final
chunk carries them in `metrics.phases`, where the OpenAI service reads them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from splitserve.protocol.kv_transfer import chunk_kv_transfer_params
from splitserve.protocol.timeline import (
    DECODE_FIRST_STEP,
    ENGINE_PHASES_KEY,
    HANDOFF,
    RESERVE,
    ROUTE,
    partition,
    queue_and_prefill,
)


class AttemptClock:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.dispatched: float | None = None  # the attempt's first engine request sent
        self.reserved: float | None = None  # push: decode's reservation answered
        self.first_token: float | None = None  # decode's first chunk arrived
        self.prefill_metrics: Mapping | None = None  # the prefill worker's final `metrics`

    def dispatch(self) -> None:
        self.dispatched = time.monotonic()

    def reservation_answered(self) -> None:
        self.reserved = time.monotonic()

    def first_chunk(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def phases(self, final_chunk: Mapping) -> dict[str, float]:
        """The attempt's phases up to its first token, from decode's final chunk."""
        dispatched = self.dispatched if self.dispatched is not None else self.started
        parts: dict[str, float] = {ROUTE: dispatched - self.started}
        if self.reserved is not None:
            parts[RESERVE] = self.reserved - dispatched
        decode_metrics = final_chunk.get("metrics")
        prefiller = self.prefill_metrics if self.prefill_metrics is not None else decode_metrics
        if isinstance(prefiller, Mapping):
            parts.update(queue_and_prefill(prefiller) or {})
        if self.prefill_metrics is not None:
            handoff = chunk_kv_transfer_params(final_chunk).handoff or {}
            transfer = _seconds(handoff, "exposed_transfer_s") + _seconds(handoff, "notification_s")
            parts[HANDOFF] = transfer
            parts[DECODE_FIRST_STEP] = max(0.0, _seconds(handoff, "exposed_handoff_s") - transfer)
        first = self.first_token if self.first_token is not None else time.monotonic()
        return partition(parts, first - self.started)


def with_phases(chunk: dict, phases: Mapping[str, float]) -> dict:
    """The final chunk with the attempt's phases in its `metrics`."""
    metrics = chunk.get("metrics")
    return {
        **chunk,
        "metrics": {**(metrics if isinstance(metrics, Mapping) else {}), ENGINE_PHASES_KEY: dict(phases)},
    }


def _seconds(report: Mapping, key: str) -> float:
    value = report.get(key)
    return float(value) if isinstance(value, int | float) else 0.0
