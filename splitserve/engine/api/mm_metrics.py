"""Prometheus metrics of images in an engine (any role), read at scrape time.

A prefill/decode/collocated engine: images encoded by its own vision tower, images loaded
from the encoder-cache connector (an encoder worker's output), its own encoder cache's
hits and misses, and the time in the vision tower. An encoder worker: images encoded,
images already in the encoder cache (not encoded again), time in the vision tower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "splitserve"


class MultiModalCollector(Collector):
    """`stats` returns the engine's `MultiModalStats`."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily(
            f"{PREFIX}_images_encoded", "Images run through this engine's vision tower.", s.images_encoded
        )
        yield CounterMetricFamily(
            f"{PREFIX}_images_loaded",
            "Image embeddings loaded from the encoder-cache connector (an encoder worker's).",
            s.images_loaded,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_encoder_cache_hits",
            "Images found in this engine's encoder cache.",
            s.encoder_cache_hits,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_encoder_cache_misses",
            "Images not in this engine's encoder cache (loaded or encoded).",
            s.encoder_cache_misses,
        )
        yield CounterMetricFamily(f"{PREFIX}_encoder_seconds", "Time in the vision tower.", s.encode_seconds)


class EncoderWorkerCollector(Collector):
    """The encoder role's counters (an `EncoderWorker`)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self._worker
        yield CounterMetricFamily(
            f"{PREFIX}_images_encoded", "Images run through the vision tower.", w.num_images_encoded
        )
        yield CounterMetricFamily(
            f"{PREFIX}_encoder_cache_hits",
            "Images already in the encoder cache: not encoded again.",
            w.num_cache_hits,
        )
        yield CounterMetricFamily(f"{PREFIX}_encoder_seconds", "Time in the vision tower.", w.encode_seconds)
