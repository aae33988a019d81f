"""The proxy's Prometheus metrics (one registry per proxy app, no module globals)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest

PREFIX = "splitserve_proxy"
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a request's phases are often a millisecond or less
_PHASE_SECONDS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # the proxy's own CPU (`sim calibrate --proxy` reads it)
        self.requests = Counter(f"{PREFIX}_requests", "Requests routed, by path.", ["path"], registry=r)
        self.retries = Counter(f"{PREFIX}_retries", "Requests retried on another decode worker.", registry=r)
        self.prefill_failures = Counter(
            f"{PREFIX}_prefill_failures", "Prefill calls that failed or could not ship their KV.", registry=r
        )
        self.fallbacks = Counter(
            f"{PREFIX}_fallbacks",
            "Requests whose decode worker computed the prompt itself.",
            ["reason"],
            registry=r,
        )
        self.decode_stall_probes = Counter(
            f"{PREFIX}_decode_stall_probes",
            "Health probes of a decode worker whose stream was silent for --stall-timeout.",
            registry=r,
        )
        self.decode_stalls = Counter(
            f"{PREFIX}_decode_stalls",
            "Decode streams migrated because their worker stalled (silent, /health unanswered).",
            registry=r,
        )
        self.resume_waits = Counter(
            f"{PREFIX}_resume_waits",
            "Times a stream waited for a decode worker to come (back) into rotation (none left).",
            registry=r,
        )
        self.resumed_prompt_tokens = Counter(
            f"{PREFIX}_resumed_prompt_tokens",
            "Prompt tokens of resumed streams (prompt + tokens streamed before), by where their "
            "KV came from: reused (a worker's prefix cache), pulled (by block hash from a worker "
            "that held it), computed (again, for the resumed request).",
            ["source"],
            registry=r,
        )
        self.errors = Counter(
            f"{PREFIX}_errors", "Requests that failed, by HTTP status.", ["status"], registry=r
        )
        self.prefill_time = Histogram(
            f"{PREFIX}_prefill_seconds", "Prefill call, sent to answered.", buckets=_SECONDS, registry=r
        )
        self.handoff_time = Histogram(
            f"{PREFIX}_handoff_seconds",
            "From the prefill worker's answer to the decode worker's first token.",
            buckets=_SECONDS,
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Engine request sent to first token.",
            buckets=_SECONDS,
            registry=r,
        )

        self.prefix_query_blocks = Counter(
            f"{PREFIX}_prefix_query_blocks",
            "Prompt blocks of routed requests (the router's prefix-cache lookups).",
            registry=r,
        )
        self.prefix_hit_blocks = Counter(
            f"{PREFIX}_prefix_hit_blocks",
            "Leading prompt blocks the chosen worker already held, by the KV event index.",
            registry=r,
        )

        # the request timeline (protocol/timeline.py): each request's seconds per phase
        self.phases = Histogram(
            f"{PREFIX}_request_phase_seconds",
            "A request's time in one phase (render, route, reserve, prefill_queue, prefill, "
            "handoff, decode_first_step, hops, decode, derender, send), per request.",
            ["phase"],
            buckets=_PHASE_SECONDS,
            registry=r,
        )
        self.derender_calls = Histogram(
            f"{PREFIX}_derender_call_seconds",
            "One derender call of a request, waiting for the render tier included.",
            buckets=_PHASE_SECONDS,
            registry=r,
        )

    # ---- TimelineSink -----------------------------------------------------------------
    def observe_phases(self, phases: Mapping[str, float]) -> None:
        for phase, seconds in phases.items():
            self.phases.labels(phase).observe(seconds)

    def observe_derender_call(self, seconds: float) -> None:
        self.derender_calls.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
