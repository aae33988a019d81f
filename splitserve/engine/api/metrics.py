"""Prometheus metrics of one engine, in a registry owned by its app (no module globals).

Engine-state gauges and counters (running/waiting requests, KV usage, prefix cache) are
read from `engine.stats()` when scraped; latencies (step time, TTFT, ITL, end-to-end) and
per-request counters are observed as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.engine.api.generate import PROMPT_SOURCES, prompt_sources

PREFIX = "splitserve"
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    60.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_BLOCK_INDEX_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class _EngineStatsCollector(Collector):
    """Reads the engine's own counters at scrape time, so they are never stale."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            f"{PREFIX}_num_requests_running", "Requests in the running batch.", s.num_running
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_num_waiting_prefill_tokens",
            "Prompt tokens still to compute (waiting and prefilling requests).",
            s.num_waiting_prefill_tokens,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_num_running_decode_blocks",
            "KV blocks held by decoding requests.",
            s.num_running_decode_blocks,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s.kv_usage
        )
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_blocks_total", "KV cache blocks.", s.num_blocks_total)
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_blocks_free", "Free KV cache blocks.", s.num_blocks_free)
        queried, hits = s.prefix_cache_queried_tokens, s.prefix_cache_hit_tokens
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queried
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_prefix_cache_hit_rate",
            "Prefix cache hits / queries, in tokens, since start.",
            hits / queried if queried else 0.0,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_num_preemptions", "Requests preempted (recomputed).", s.num_preemptions
        )
        yield CounterMetricFamily(
            f"{PREFIX}_step_thread_cpu_seconds",
            "CPU time of the engine thread in steps (its OpenMP workers' not included).",
            s.step_thread_cpu_s,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_step_thread_wait_seconds",
            "Time the engine thread waited runnable for a core in steps (Linux schedstat; 0 elsewhere).",
            s.step_thread_wait_s,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_cpu_borrowed_steps",
            "Steps run on an idle lender's CPUs as well as this engine's own.",
            s.num_borrowed_cpu_steps,
        )


class EngineMetrics:
    def __init__(self, stats: Callable[[], Any], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats))
        # process_cpu_seconds_total and friends: `sim calibrate` reads the tiers' CPU from them
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.step_time = Histogram(
            f"{PREFIX}_step_time_seconds",
            "Engine step (one forward pass) time.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.step_tokens = Counter(f"{PREFIX}_step_tokens", "Tokens computed by engine steps.", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            f"{PREFIX}_request_success", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            f"{PREFIX}_request_rejected",
            "Requests rejected before scheduling, by status.",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", registry=r)
        self.prompt_tokens_by_source = Counter(
            f"{PREFIX}_prompt_tokens_by_source",
            "Prompt tokens of finished requests by where their KV came from: reused (local prefix "
            "cache), pulled (a decode worker's held prefix, by block hash), received (computed "
            "for it by another worker), computed (here).",
            ["source"],
            registry=r,
        )
        self.reuse_stopped_block = Histogram(
            f"{PREFIX}_prompt_reuse_stopped_block",
            "Per finished request: the first prompt block neither reused nor pulled.",
            buckets=_BLOCK_INDEX_BUCKETS,
            registry=r,
        )

    def on_step(self, step_time_s: float, num_tokens: int) -> None:
        """Engine step listener; called from the engine thread (prometheus_client is thread-safe)."""
        self.step_time.observe(step_time_s)
        self.step_tokens.inc(num_tokens)

    def on_rejected(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def request_tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's outputs: TTFT once, ITL per token after the first."""

    def __init__(self, metrics: EngineMetrics):
        self._metrics = metrics
        self._last_token_time: float | None = None
        self._finished = False

    def on_output(
        self,
        new_token_ids: list[int],
        times: dict | None,
        finished: bool,
        finish_reason: str | None,
        num_prompt_tokens: int,
    ) -> None:
        m = self._metrics
        times = times or {}
        n = len(new_token_ids)
        if n:
            m.generation_tokens.inc(n)
            token_time = times.get("last_token_time")
            if self._last_token_time is None:
                first, arrival = times.get("first_token_time"), times.get("arrival_time")
                if first is not None and arrival is not None:
                    m.ttft.observe(max(0.0, first - arrival))
                n -= 1  # the first token has a TTFT, not an ITL
                self._last_token_time = first if first is not None else token_time
            if n and token_time is not None and self._last_token_time is not None:
                gap = max(0.0, token_time - self._last_token_time) / n
                for _ in range(n):
                    m.itl.observe(gap)
            if token_time is not None:
                self._last_token_time = token_time
        if finished and not self._finished:
            self._finished = True
            m.requests.labels(finish_reason=str(finish_reason)).inc()
            m.prompt_tokens.inc(num_prompt_tokens)
            sources = prompt_sources(times, num_prompt_tokens)
            for name in PROMPT_SOURCES:
                if sources[name]:
                    m.prompt_tokens_by_source.labels(source=name.removeprefix("prompt_tokens_")).inc(
                        sources[name]
                    )
            if sources["prompt_reuse_stopped_block"] is not None:
                m.reuse_stopped_block.observe(sources["prompt_reuse_stopped_block"])
            end, arrival = (
                times.get("finished_time") or times.get("last_token_time"),
                times.get("arrival_time"),
            )
            if end is not None and arrival is not None:
                m.e2e.observe(max(0.0, end - arrival))

    def on_aborted(self) -> None:
        """The client went away or the request was aborted before a final output."""
        if not self._finished:
            self._finished = True
            self._metrics.requests.labels(finish_reason="abort").inc()
