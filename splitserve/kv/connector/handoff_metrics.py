"""Prometheus metrics of P/D handoffs, one registry per connector (no module globals).

The engine app forwards this registry into its own `/metrics` (see `engine/api/kv_routes.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.kv.transport.arrivals import TransferResult

PREFIX = "splitserve_kv"
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


GAUGES = {  # name -> help; the connector reads the values at each scrape
    "reservations_active": "Decode: requests holding blocks for incoming KV.",
    "reserved_blocks": "Decode: blocks reserved for incoming KV.",
    "holds_active": "Prefill (pull): finished requests whose blocks await a reader.",
    "prefix_lends_active": "Decode: requests whose held prefix blocks are lent to a prefill worker.",
}


class _Gauges(Collector):
    def __init__(self, read: Callable[[], dict[str, float]]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        for name, value in self._read().items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", GAUGES[name], value)


class HandoffMetrics:
    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None):
        """`gauges`: the live value of each of GAUGES."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes = Counter(f"{PREFIX}_transfer_bytes", "KV bytes moved.", ["direction"], registry=r)
        self.state_bytes = Counter(
            f"{PREFIX}_state_bytes",
            "Hybrid models: Mamba state bytes moved (whole states, apart from the KV bytes).",
            ["direction"],
            registry=r,
        )
        self.transfers = Counter(
            f"{PREFIX}_transfers", "KV transfers finished.", ["side", "outcome"], registry=r
        )
        self.transfer_time = Histogram(
            f"{PREFIX}_transfer_seconds",
            "Decode: from the start of waiting (reservation or pull) to the last arrival.",
            buckets=_SECONDS,
            registry=r,
        )
        self.send_time = Histogram(
            f"{PREFIX}_send_seconds",
            "Prefill: time spent copying one request's KV out.",
            buckets=_SECONDS,
            registry=r,
        )
        self.exposed_handoff = Histogram(
            f"{PREFIX}_exposed_handoff_seconds",
            "Decode: first token minus the moment prefill's last layer was computed.",
            buckets=_SECONDS,
            registry=r,
        )
        self.notification_delay = Histogram(
            f"{PREFIX}_notification_delay_seconds",
            "Decode: from the last KV arrival to the engine picking the request up.",
            buckets=_SECONDS,
            registry=r,
        )
        self.failures = Counter(
            f"{PREFIX}_transfer_failures", "KV transfers that failed.", ["side"], registry=r
        )
        self.fallbacks = Counter(
            f"{PREFIX}_fallbacks", "Requests that could not use transferred KV.", ["action"], registry=r
        )
        self.prefix_blocks = Counter(
            f"{PREFIX}_prefix_blocks",
            "Bidirectional P/D: held prefix blocks lent by decode, and pulled by prefill.",
            ["direction"],
            registry=r,
        )
        self.prefix_lends = Counter(
            f"{PREFIX}_prefix_lends", "Decode: prefix leases ended, by how.", ["outcome"], registry=r
        )
        self.reservations_expired = Counter(
            f"{PREFIX}_reservations_expired", "Reservations released by their TTL.", registry=r
        )
        if gauges is not None:
            r.register(_Gauges(gauges))

    def count_arrival(
        self, side: str, result: TransferResult, num_blocks: int, transfer_s: float, fallback: str | None
    ) -> None:
        """A transfer into this worker ended (`side`: "decode" or "prefix_pull");
        `fallback`: what a failure made the request do ("fail", "recompute"; None: nothing)."""
        self.bytes.labels("received").inc(result.num_bytes)
        self.state_bytes.labels("received").inc(result.state_bytes)
        if result.ok:
            self.transfers.labels(side, "ok").inc()
            if side == "prefix_pull":
                self.prefix_blocks.labels("pulled").inc(num_blocks)
            else:
                self.transfer_time.observe(transfer_s)
            return
        self.transfers.labels(side, "failed").inc()
        self.failures.labels(side).inc()
        if result.expired:
            self.reservations_expired.inc()
        if fallback is not None:
            self.fallbacks.labels(fallback).inc()


class ForwardRegistry(Collector):
    """Expose another registry's metrics through this one."""

    def __init__(self, source: CollectorRegistry):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        yield from self._source.collect()
