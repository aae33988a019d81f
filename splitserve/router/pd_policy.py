"""Per-request P/D decisions: which prompts go through the prefill pool at all, and the
clients' conversation hints."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

TransferMode = Literal["push", "pull"]
PDDecisionRule = Literal["cost", "threshold"]


@dataclass(frozen=True)
class PDPolicy:
    # With decision "threshold": a prompt whose uncached part is shorter than this is
    # prefilled on the decode worker, whatever the load. "cost" decides each request on
    # its uncached tokens, the workers' load and the deployment's costs (pd_decision.py).
    min_prefill_tokens: int = 64
    mode: TransferMode = "push"
    reserve_timeout_s: float = 30.0
    # A decode stream silent this long gets its worker's /health probed; a worker that
    # does not answer is stalled and the stream migrates (router/stall.py).
    stall_timeout_s: float = 5.0
    # push: prefill pulls the leading blocks decode already holds (by block hash) instead
    # of computing them; off, KV moves one way only (prefill recomputes them)
    bidirectional: bool = True
    # A stream whose decode worker failed, with no other decode worker to move to, waits
    # this long (over the whole stream) for one to come (back) into rotation (`up`
    # restarts a dead or stalled one) before it ends with 503 (0: it ends at once).
    resume_wait_s: float = 60.0
    decision: PDDecisionRule = "cost"

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0:
            raise ValueError("min_prefill_tokens must be >= 0")
        if self.mode not in ("push", "pull"):
            raise ValueError(f"unknown transfer mode {self.mode!r} (push or pull)")
        if self.decision not in ("cost", "threshold"):
            raise ValueError(f"unknown P/D decision {self.decision!r} (cost or threshold)")
        if not self.stall_timeout_s > 0:  # also rejects NaN
            raise ValueError("stall_timeout_s must be positive")
        if not self.resume_wait_s >= 0:  # also rejects NaN
            raise ValueError("resume_wait_s must be >= 0")

    def use_prefill_pool(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Whether the uncached part of the prompt is worth a prefill worker."""
        return num_prompt_tokens - num_cached_tokens >= self.min_prefill_tokens


class ConversationHints:
    """A client's `conversation_id` → the decode worker that last served it (bounded, LRU).
    Only a tie-breaker: the KV index, by block hash, decides who holds a prompt's prefix;
    the hint helps when the index knows nothing (no KV events, or a prompt shorter than a
    block). Any client may name any ID: it moves placement, never access to KV."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._workers: OrderedDict[str, str] = OrderedDict()

    def worker_of(self, conversation_id: str | None) -> str | None:
        if conversation_id is None:
            return None
        with self._lock:
            url = self._workers.get(conversation_id)
            if url is not None:
                self._workers.move_to_end(conversation_id)
            return url

    def remember(self, conversation_id: str | None, worker_url: str) -> None:
        if conversation_id is None:
            return
        with self._lock:
            self._workers[conversation_id] = worker_url
            self._workers.move_to_end(conversation_id)
            while len(self._workers) > self.capacity:
                self._workers.popitem(last=False)
