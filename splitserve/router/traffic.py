"""What the proxy has been asked lately: each request's arrival, prompt length and (once it
ends) output length, kept for `KEPT_S` (at most `KEPT_REQUESTS` of them). A planner reads windows of it
(`ray_serve/planner_loop.py`): the arrival rate and the joint length distribution, not
only their means."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.protocol.generate_request import GenerateRequest
from splitserve.router.prefill_report import is_final

KEPT_S = 600.0
KEPT_REQUESTS = 200_000
# What a request without max_tokens (up to the context) counts as while it runs.
UNBOUNDED_OUTPUT_GUESS = 256


@dataclass(slots=True)  # a proxy keeps tens of thousands: ~70 bytes each, not ~170
class ObservedRequest:
    arrived_at: float  # time.monotonic()
    prompt_tokens: int
    max_tokens: int
    output_tokens: int | None = None  # None until it ends

    def saw(self, chunk: dict) -> None:
        """A chunk of its stream: the final one says how many tokens it produced."""
        usage = chunk.get("usage")
        if usage and is_final(chunk):
            self.output_tokens = int(usage.get("completion_tokens") or 0)


class TrafficWindow(NamedTuple):
    seconds: float
    arrivals: int
    lengths: tuple[tuple[int, int], ...]  # (prompt, output) per arrival: output so far as asked

    @property
    def rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0


class TrafficLog:
    def __init__(self, kept_s: float = KEPT_S, kept: int = KEPT_REQUESTS) -> None:
        self.kept_s = kept_s
        self.requests: deque[ObservedRequest] = deque(maxlen=kept)

    def arrived(self, request: GenerateRequest, now: float | None = None) -> ObservedRequest:
        entry = ObservedRequest(
            time.monotonic() if now is None else now,
            len(request.token_ids),
            request.sampling_params.max_tokens or UNBOUNDED_OUTPUT_GUESS,
        )
        self.requests.append(entry)
        while self.requests[0].arrived_at < entry.arrived_at - self.kept_s:
            self.requests.popleft()
        return entry

    def window(self, seconds: float, now: float | None = None) -> TrafficWindow:
        """The requests that arrived in the last `seconds`: a request still running counts
        with the output it asked for (`max_tokens`), one that ended with what it produced."""
        end = time.monotonic() if now is None else now
        recent = [r for r in self.requests if end - seconds <= r.arrived_at <= end]
        lengths = tuple(
            (r.prompt_tokens, r.output_tokens if r.output_tokens is not None else r.max_tokens)
            for r in recent
        )
        return TrafficWindow(seconds, len(recent), lengths)
