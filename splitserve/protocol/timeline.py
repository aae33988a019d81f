"""A request's timeline: where its time went, phase by phase, on the serving side.

Every OpenAI request through `serve` or the P/D proxy records its phases (the OpenAI
service's own: render, the engine's time to first chunk, waiting for later chunks,
derender calls, sending; and, within the time to first chunk, the engine client's:
route, reserve, prefill queue, prefill, handoff, decode's first step). The phases do
not overlap, so they sum to no more than the request's wall time; what the engine
client cannot attribute is `hops` (HTTP hops and anything unmeasured).

Opt-in for clients: the request header `x-splitserve-timeline: 1` makes the response
carry `splitserve_timeline: {phase: seconds}`: the non-streaming response as a top-level
field, a stream in its last chunk before `[DONE]` (the usage chunk when usage was asked
for, else a chunk of its own with `choices: []`, the usage chunk's shape). OpenAI clients
keep unknown fields (`chunk.model_extra`), so no client's parsing changes.

Between an engine client and the service the engine's phases ride in a final chunk's
`metrics.phases`; an engine that does not send them (a plain engine, vLLM) is read from
vLLM's per-request `metrics` (`queue_time_ms`, `time_to_first_token_ms`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

TIMELINE_HEADER = "x-splitserve-timeline"
TIMELINE_FIELD = "splitserve_timeline"
ENGINE_PHASES_KEY = "phases"  # in an engine chunk's `metrics`

# In order along a request. Before the first engine chunk:
RENDER = "render"  # the chat or prompt rendered to token IDs (the render tier, or in process)
ROUTE = "route"  # the proxy picks the workers and decides the path
RESERVE = "reserve"  # push: decode request sent → decode's reservation answered
PREFILL_QUEUE = "prefill_queue"  # the prefilling engine's queue (arrival → scheduled)
PREFILL = "prefill"  # the prefilling engine computes the prompt (scheduled → its token)
HANDOFF = "handoff"  # P/D: exposed KV transfer + decode's notification
DECODE_FIRST_STEP = "decode_first_step"  # P/D: decode's step from the KV's arrival to the first token
HOPS = "hops"  # the rest of the time to the first engine chunk: HTTP hops, unmeasured waits
# After it:
DECODE = "decode"  # waiting for the engine's later chunks
DERENDER = "derender"  # derender calls (token IDs → text), all of them
SEND = "send"  # the events handed to the client's connection
PHASES = (
    RENDER,
    ROUTE,
    RESERVE,
    PREFILL_QUEUE,
    PREFILL,
    HANDOFF,
    DECODE_FIRST_STEP,
    HOPS,
    DECODE,
    DERENDER,
    SEND,
)
ENGINE_PHASES = (ROUTE, RESERVE, PREFILL_QUEUE, PREFILL, HANDOFF, DECODE_FIRST_STEP, HOPS)


class TimelineSink(Protocol):
    """Where finished timelines go (the proxy's Prometheus histograms)."""

    def observe_phases(self, phases: Mapping[str, float]) -> None: ...

    def observe_derender_call(self, seconds: float) -> None: ...


def wanted(header_value: str | None) -> bool:
    """Whether a request's `x-splitserve-timeline` header asks for the timeline."""
    return (header_value or "").strip().lower() in ("1", "true", "yes", "on")


def partition(
    parts: Mapping[str, float], budget_s: float, order: tuple[str, ...] = ENGINE_PHASES
) -> dict[str, float]:
    """`parts` laid end to end within `budget_s` (each clipped to what is left, never
    negative), in `order`; what is left goes to `hops`. The result sums to `budget_s`."""
    left = max(0.0, budget_s)
    result: dict[str, float] = {}
    for name in order:
        if name in parts:
            value = min(max(0.0, float(parts[name])), left)
            result[name] = value
            left -= value
    result[HOPS] = result.get(HOPS, 0.0) + left
    return result


def engine_phases(chunk: Mapping) -> dict[str, float] | None:
    """The engine's phases from a final chunk: its `metrics.phases` (an engine client
    that measured them), else vLLM's per-request metrics; None when the chunk has neither."""
    metrics = chunk.get("metrics")
    if not isinstance(metrics, Mapping):
        return None
    phases = metrics.get(ENGINE_PHASES_KEY)
    if isinstance(phases, Mapping):
        return {str(k): float(v) for k, v in phases.items() if isinstance(v, int | float)}
    return queue_and_prefill(metrics)


def queue_and_prefill(metrics: Mapping) -> dict[str, float] | None:
    """An engine's queue and prefill from vLLM's per-request metrics (milliseconds)."""
    queue_ms = metrics.get("queue_time_ms")
    ttft_ms = metrics.get("time_to_first_token_ms")
    if not isinstance(ttft_ms, int | float):
        return None
    queue_s = float(queue_ms) / 1e3 if isinstance(queue_ms, int | float) else 0.0
    return {PREFILL_QUEUE: queue_s, PREFILL: max(0.0, float(ttft_ms) / 1e3 - queue_s)}


class RequestTimeline:
    """One API request's phases, measured by the OpenAI service as it runs."""

    def __init__(self, sink: TimelineSink | None = None) -> None:
        self.started = time.monotonic()
        self._sink = sink
        self._phases: dict[str, float] = {}
        self._first_chunk_s: float | None = None
        self._engine: dict[str, float] | None = None

    def add(self, phase: str, seconds: float) -> None:
        self._phases[phase] = self._phases.get(phase, 0.0) + max(0.0, seconds)

    def derender_call(self, seconds: float) -> None:
        self.add(DERENDER, seconds)
        if self._sink is not None:
            self._sink.observe_derender_call(seconds)

    def first_chunk(self, seconds: float) -> None:
        """The engine requests started and the first chunk came back after `seconds`."""
        self._first_chunk_s = seconds

    def engine(self, phases: Mapping[str, float] | None) -> None:
        """The first choice's engine phases (they split the time to the first chunk)."""
        if phases is not None and self._engine is None:
            self._engine = dict(phases)

    def phases(self) -> dict[str, float]:
        """Every phase measured so far, in request order, seconds."""
        phases = dict(self._phases)
        if self._first_chunk_s is not None:
            for name, seconds in partition(self._engine or {}, self._first_chunk_s).items():
                phases[name] = phases.get(name, 0.0) + seconds
        return {name: round(phases[name], 6) for name in PHASES if name in phases}

    def finish(self) -> dict[str, float]:
        """The phases, also handed to the sink (once per request)."""
        phases = self.phases()
        if self._sink is not None:
            self._sink.observe_phases(phases)
            self._sink = None
        return phases
