"""The encoder pool in front of prefill/decode: images are encoded once, by hash.

For a generate request with images (`features` from the render tier, with pixels), the
proxy sends the images it has not seen encoded to an encoder worker
(`splitserve engine --role encoder`, `POST /inference/v1/encode`), which publishes their
embeddings to the encoder cache the prefill/decode engines share; the request then goes
on carrying hashes, placements and grids only (`features_without_pixels`), which is what
the engines need for M-RoPE positions and block hashes. An encoder that fails or does not
answer costs only time: the request goes on with its pixels and the engines encode the
images themselves. Text-only requests never touch the pool.

The proxy remembers the hashes encoded recently (bounded), so the same image twice is one
encoder job; this relies on the encoder cache keeping what it was given (the shared-memory
cache keeps one file per image until the deployment ends).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.multimodal import features_without_pixels
from splitserve.runtime.http_pool import pooled_client

logger = logging.getLogger(__name__)

ENCODE_PATH = "/inference/v1/encode"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EncoderPoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        prefix = "splitserve_proxy_encoder"
        self.jobs = Counter(f"{prefix}_images_sent", "Images sent to an encoder worker.", registry=registry)
        self.skipped = Counter(
            f"{prefix}_images_skipped",
            "Images already encoded (hash seen): no encoder job.",
            registry=registry,
        )
        self.failures = Counter(
            f"{prefix}_failures",
            "Encoder calls that failed: the engines encode those images themselves.",
            registry=registry,
        )
        self.time = Histogram(
            f"{prefix}_call_seconds", "Encoder call, sent to answered.", buckets=_SECONDS, registry=registry
        )
        self.bytes = Counter(
            f"{prefix}_hop_bytes",
            "Bytes of image features sent per hop (encoder: pixels; engines: hashes and placements).",
            ["hop"],
            registry=registry,
        )


def select_images(features: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    """The features of the images at `indices` only."""
    return {
        key: {"image": [features[key]["image"][i] for i in indices]}
        for key in ("mm_hashes", "mm_placeholders", "kwargs_data")
    }


def _has_images(features: Any) -> bool:
    return isinstance(features, dict) and bool((features.get("mm_hashes") or {}).get("image"))


class EncoderPool:
    """Encoder workers, used in turn, and the hashes they have encoded."""

    def __init__(
        self,
        urls: list[str],
        registry: CollectorRegistry,
        *,
        timeout_s: float = 60.0,
        max_known_hashes: int = 100_000,
        allow_empty: bool = False,
    ) -> None:
        """`allow_empty`: encoders join later (`add`, as a Ray Serve deployment brings them
        up); with none, requests go on with their pixels and the engines encode."""
        if not urls and not allow_empty:
            raise ValueError("an encoder pool needs at least one encoder URL")
        self.urls = [url.rstrip("/") for url in urls]
        self._turns = itertools.count()
        self._http = pooled_client(read_timeout_s=timeout_s)
        self.metrics = EncoderPoolMetrics(registry)
        self.known: OrderedDict[str, None] = OrderedDict()  # hashes encoded, oldest first
        # hashes being encoded for another request (n > 1, or a popular image arriving
        # twice at once): awaited, not sent again; the result says whether it worked
        self.in_flight: dict[str, asyncio.Future[bool]] = {}
        self.max_known_hashes = max_known_hashes

    async def close(self) -> None:
        await self._http.aclose()

    def add(self, url: str) -> None:
        """An encoder joins the rotation (no-op when it is there)."""
        url = url.rstrip("/")
        if url not in self.urls:
            self.urls = [*self.urls, url]  # a new list: a job picking now sees the old one
            logger.warning("encoder %s joined", url)

    def remove(self, url: str) -> None:
        """An encoder leaves the rotation; what it encoded stays in the encoder cache."""
        url = url.rstrip("/")
        if url in self.urls:
            self.urls = [u for u in self.urls if u != url]
            logger.warning("encoder %s left", url)

    def _remember(self, hashes: list[str]) -> None:
        for image_hash in hashes:
            self.known[image_hash] = None
            self.known.move_to_end(image_hash)
        while len(self.known) > self.max_known_hashes:
            self.known.popitem(last=False)

    async def encode(self, request_id: str, features: dict[str, Any]) -> bool:
        """Encode the images not encoded yet (one job per distinct image); whether every
        image of `features` is now in the encoder cache."""
        hashes = features["mm_hashes"]["image"]
        todo: dict[str, int] = {}  # hash -> its first index
        waits: list[asyncio.Future[bool]] = []
        for index, image_hash in enumerate(hashes):
            if image_hash in self.known or image_hash in todo:
                self.metrics.skipped.inc()
            elif image_hash in self.in_flight:
                self.metrics.skipped.inc()
                waits.append(self.in_flight[image_hash])
            else:
                todo[image_hash] = index
        done = asyncio.get_running_loop().create_future()
        for image_hash in todo:
            self.in_flight[image_hash] = done
        encoded = False  # cancelled: whoever waits for these images lets the engines encode them
        try:
            encoded = await self._send(request_id, features, todo) if todo else True
        finally:
            for image_hash in todo:
                del self.in_flight[image_hash]
            done.set_result(encoded)
        others = await asyncio.gather(*(asyncio.shield(wait) for wait in waits))
        return encoded and all(others)

    async def _send(self, request_id: str, features: dict[str, Any], todo: dict[str, int]) -> bool:
        """One encoder job for the images `todo` names; whether it succeeded."""
        urls = self.urls
        if not urls:
            self.metrics.failures.inc()
            return False  # no encoder (yet): the engines encode the images
        url = urls[next(self._turns) % len(urls)]
        content = json.dumps(
            {"request_id": request_id, "features": select_images(features, list(todo.values()))}
        ).encode()
        start = time.perf_counter()
        try:
            response = await self._http.post(
                url + ENCODE_PATH, content=content, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            logger.warning("encoder %s failed (%s); the engines encode the images", url, exc)
            self.metrics.failures.inc()
            return False
        self.metrics.time.observe(time.perf_counter() - start)
        self.metrics.bytes.labels("encoder").inc(len(content))
        if response.status_code != 200:
            logger.warning("encoder %s answered %s; the engines encode the images", url, response.status_code)
            self.metrics.failures.inc()
            return False
        self.metrics.jobs.inc(len(todo))
        self._remember(list(todo))
        return True


class EncoderPoolEngineClient(EngineClient):
    """An `EngineClient` (the P/D one) behind the encoder pool."""

    def __init__(self, engines: EngineClient, pool: EncoderPool) -> None:
        self.engines = engines
        self.pool = pool

    def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        features = request.features
        if _has_images(features) and await self.pool.encode(request.request_id, features):
            features = features_without_pixels(features)
            request = dataclasses.replace(request, features=features)
            self.pool.metrics.bytes.labels("engines").inc(len(json.dumps(features)))
        async for chunk in self.engines.generate(request):
            yield chunk

    async def abort(self, request_ids: list[str]) -> None:
        await self.engines.abort(request_ids)

    async def check_health(self) -> bool:
        return await self.engines.check_health()

    async def close(self) -> None:
        await self.pool.close()
        await self.engines.close()
