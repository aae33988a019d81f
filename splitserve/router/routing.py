"""How the proxy picks a worker of a pool (`--routing`): one picker per policy.

- cache-aware (default): cost = overlap_weight × prompt blocks the worker lacks (by the KV
  event index, router/kv_index.py; a block the KV store holds past the worker's own run
  counts 0.75 held in RAM, 0.25 on disk) + prefill_load_weight × blocks of prompt tokens queued
  for prefill on it + decode_load_weight × KV blocks its decoding requests hold (both from
  its reports and the router's own accounting, router/load.py) + load_weight × requests
  in flight, lowest wins; the client's conversation hint is worth half a block.
- least-loaded: fewest requests in flight, then fewest served (equal loads rotate).
- round-robin: the pool's healthy workers in turn, whatever they hold or run.
- text-prefix (production-stack's prefix-aware router): the worker whose recently routed
  prompt text (the client's message contents, `prompt_text`) shares the longest common
  character prefix with this one, when that prefix reaches `min_prefix_chars`; otherwise
  least-loaded. It never learns what the engines evicted, and cannot see cache_salt or
  what the chat template renders: the baseline cache-aware routing is measured against.

Every pick, first try, retry or migration, goes through `Router.pick`, which only chooses
among the pool's healthy workers not excluded.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from splitserve.protocol.frontend_client import DerenderedPiece, DerenderPiece, FrontendClient, RenderedPrompt
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.router.kv_index import KVBlockIndex, KVRoutingWeights, request_block_hashes
from splitserve.router.load import LoadTracker
from splitserve.router.workers import Worker, WorkerPool, WorkerRole


class RoutingPolicy(enum.StrEnum):
    CACHE_AWARE = "cache-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    TEXT_PREFIX = "text-prefix"


@dataclass(frozen=True)
class TextPrefixLimits:
    min_prefix_chars: int = 64  # a shorter common prefix is no match (least-loaded instead)
    texts_per_worker: int = 256  # the most recent distinct prompts remembered per worker
    max_text_chars: int = 16384  # a prompt's text is remembered up to this many characters


def common_prefix_length(a: str, b: str) -> int:
    """The length of the longest common prefix: binary search on slice equality, which
    compares in C."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class TextPrefixMemory:
    """Per worker, the text of the prompts last routed to it (bounded, LRU)."""

    def __init__(self, limits: TextPrefixLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._texts: dict[str, OrderedDict[str, None]] = {}

    def remember(self, worker_url: str, text: str) -> None:
        text = text[: self.limits.max_text_chars]
        with self._lock:
            texts = self._texts.setdefault(worker_url, OrderedDict())
            texts[text] = None
            texts.move_to_end(text)
            while len(texts) > self.limits.texts_per_worker:
                texts.popitem(last=False)

    def matched_chars(self, worker_url: str, text: str) -> int:
        """The longest common prefix of `text` with a remembered prompt of the worker;
        0 when below the minimum."""
        text = text[: self.limits.max_text_chars]
        head = text[: self.limits.min_prefix_chars]
        if len(head) < self.limits.min_prefix_chars:
            return 0
        with self._lock:  # only prompts that reach the minimum are measured
            seen = [t for t in self._texts.get(worker_url, ()) if t.startswith(head)]
        return max((common_prefix_length(text, t) for t in seen), default=0)


DEFAULT_BLOCK_SIZE = 16  # the engines' default, for a worker whose KV events say nothing


class Router:
    def __init__(
        self,
        policy: RoutingPolicy,
        kv_index: KVBlockIndex,
        weights: KVRoutingWeights,
        text_limits: TextPrefixLimits | None = None,
    ) -> None:
        self.policy = policy
        self.kv_index = kv_index
        self.weights = weights
        self.loads = LoadTracker()
        self.block_sizes: dict[str, int] = {}  # per worker URL, from its KV events info
        self.texts = TextPrefixMemory(text_limits or TextPrefixLimits())
        self._lock = threading.Lock()
        self._next: dict[WorkerRole, int] = {}  # round-robin: each pool's next position

    def pick(
        self,
        pool: WorkerPool,
        role: WorkerRole,
        request: GenerateRequest,
        exclude: set[str] | frozenset[str] = frozenset(),
        hinted: str | None = None,
    ) -> Worker | None:
        """A healthy worker of `role` not in `exclude`, by the policy; None when none is left."""
        if self.policy is RoutingPolicy.CACHE_AWARE:
            return self._cache_aware(pool, role, request, exclude, hinted)
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return self._round_robin(pool, role, exclude)
        if self.policy is RoutingPolicy.TEXT_PREFIX:
            return self._text_prefix(pool, role, request, exclude)
        return pool.pick(role, exclude)  # least-loaded

    def _cache_aware(
        self,
        pool: WorkerPool,
        role: WorkerRole,
        request: GenerateRequest,
        exclude: set[str] | frozenset[str],
        hinted: str | None,
    ) -> Worker | None:
        hashes = request_block_hashes(request)
        weights, index = self.weights, self.kv_index

        def cost(worker: Worker) -> float:
            local = index.matched_blocks(worker.url, hashes)
            # past its own run, a worker loads what the KV store holds (credited below a hit)
            uncached = len(hashes) - local - index.store_credit(hashes, local, weights.store_credits)
            hint = 0.5 * weights.overlap_weight if worker.url == hinted else 0.0
            load = self.loads.load(worker.url)
            return (
                weights.overlap_weight * uncached
                + weights.prefill_load_weight * load.queued_prefill_tokens / self.block_size(worker.url)
                + weights.decode_load_weight * load.running_decode_blocks
                + weights.load_weight * worker.in_flight
                - hint
            )

        return pool.pick(role, exclude, cost)

    def block_size(self, worker_url: str) -> int:
        return self.block_sizes.get(worker_url) or DEFAULT_BLOCK_SIZE

    def _round_robin(
        self, pool: WorkerPool, role: WorkerRole, exclude: set[str] | frozenset[str]
    ) -> Worker | None:
        urls = [w.url for w in pool.workers(role)]
        if not urls:
            return None
        with self._lock:
            start = self._next.get(role, 0) % len(urls)

            def distance(worker: Worker) -> float:  # the first healthy one at or after `start`
                return (urls.index(worker.url) - start) % len(urls) if worker.url in urls else len(urls)

            chosen = pool.pick(role, exclude, distance)
            if chosen is not None and chosen.url in urls:
                self._next[role] = urls.index(chosen.url) + 1
            return chosen

    def _text_prefix(
        self, pool: WorkerPool, role: WorkerRole, request: GenerateRequest, exclude: set[str] | frozenset[str]
    ) -> Worker | None:
        text = request.prompt_text
        if not text:
            return pool.pick(role, exclude)
        chosen = pool.pick(role, exclude, lambda worker: -self.texts.matched_chars(worker.url, text))
        if chosen is not None:
            self.texts.remember(chosen.url, text)
        return chosen


def chat_text(request: ChatCompletionRequest) -> str:
    """The text the client sent: its messages' text contents, concatenated in order."""
    return "".join(message.text() for message in request.messages)


class PromptTextFrontend(FrontendClient):
    """The render tier, with each generate request carrying the client's prompt text
    (`prompt_text`, a routing hint engine clients drop) for the text-prefix router."""

    def __init__(self, inner: FrontendClient) -> None:
        self.inner = inner

    async def models(self) -> dict[str, Any]:
        return await self.inner.models()

    async def render_chat(self, request: ChatCompletionRequest) -> RenderedPrompt:
        rendered = await self.inner.render_chat(request)
        generate = dataclasses.replace(rendered.generate, prompt_text=chat_text(request))
        return RenderedPrompt(generate, rendered.state)

    async def render_completion(self, request: CompletionRequest) -> list[RenderedPrompt]:
        rendered = await self.inner.render_completion(request)
        prompts = request.prompts()
        if len(prompts) != len(rendered):
            return rendered
        return [
            RenderedPrompt(dataclasses.replace(r.generate, prompt_text=p), r.state)
            if isinstance(p, str)
            else r
            for r, p in zip(rendered, prompts, strict=True)
        ]

    async def derender(self, pieces: list[DerenderPiece]) -> list[DerenderedPiece]:
        return await self.inner.derender(pieces)

    async def close(self) -> None:
        await self.inner.close()
