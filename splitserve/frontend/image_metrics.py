"""The render tier's image counters and their Prometheus form (one per Renderer)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class ImageStats(Collector):
    """Images preprocessed, refused, their processed pixel bytes (what is sent on to the
    engine or the encoder pool) and the CPU time spent on them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # renders may run on several threads
        self.images_preprocessed = 0
        self.requests_refused = 0
        self.pixel_bytes = 0
        self.seconds = 0.0

    def on_images(self, count: int, pixel_bytes: int, seconds: float) -> None:
        with self._lock:
            self.images_preprocessed += count
            self.pixel_bytes += pixel_bytes
            self.seconds += seconds

    def on_refused(self) -> None:
        with self._lock:
            self.requests_refused += 1

    def collect(self) -> Iterator[Metric]:
        prefix = "splitserve_render"
        yield CounterMetricFamily(
            f"{prefix}_images_preprocessed",
            "Images decoded, resized and patchified.",
            self.images_preprocessed,
        )
        yield CounterMetricFamily(
            f"{prefix}_image_requests_refused",
            "Requests whose images were refused (400/413).",
            self.requests_refused,
        )
        yield CounterMetricFamily(
            f"{prefix}_image_pixel_bytes",
            "Processed pixel bytes sent on (render -> engine/encoder hop).",
            self.pixel_bytes,
        )
        yield CounterMetricFamily(f"{prefix}_image_seconds", "Time preprocessing images.", self.seconds)

    def render(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(self)
        ProcessCollector(registry=registry)  # the render tier's CPU (`sim calibrate --proxy` reads it)
        return generate_latest(registry)
