"""Offered load: when sessions start, how many requests may be in flight, when to stop.

Sessions (conversations; one request each unless --turns > 1) start at the arrival times
of a Poisson, gamma or constant process of the given rate, on an absolute schedule so
that slow sends never stretch it. Each session sends its turns one after another: turn
k + 1 resends the conversation with turn k's real answer in it, after an optional think
time. A concurrency cap, when set, bounds requests in flight; an arrival that finds the
cap reached waits in the client, and its TTFT is timed from the moment it is sent.
The first `warmup` requests sent are marked warm-up and left out of every metric.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.bench.client import StreamingClient
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.workload import Session, SessionFactory
from splitserve.goodput import ARRIVALS, interarrival_times


@dataclass(frozen=True)
class LoadSpec:
    rate: float = math.inf  # sessions started per second; inf starts them all at once
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular
    concurrency: int | None = None
    num_requests: int | None = 40  # measured requests (warm-up comes on top)
    duration: float | None = None  # seconds during which new requests may start
    warmup: int = 0
    think_time: float = 0.0  # seconds between an answer and the next turn
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.arrival!r}: use one of {ARRIVALS}")
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give a number of requests or a duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"number of requests must be at least 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be positive, got {self.duration}")
        if self.duration is not None and math.isinf(self.rate) and self.concurrency is None:
            raise ValueError("a duration with an unbounded rate needs a concurrency cap")
        if self.warmup < 0 or self.think_time < 0:
            raise ValueError("warm-up and think time cannot be negative")


class LoadResult(NamedTuple):
    records: list[RequestRecord]  # in completion order, warm-up included (flagged)
    wall: float  # seconds from the first arrival to the last completion


class _Run:
    """State shared by the tasks of one load level."""

    def __init__(self, spec: LoadSpec, client: StreamingClient, on_record: Callable[[RequestRecord], None]):
        self.spec = spec
        self.client = client
        self.on_record = on_record
        self.clock = time.perf_counter()
        self.deadline = self.clock + spec.duration if spec.duration is not None else math.inf
        self.limit = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
        self.next_id = 0
        self.records: list[RequestRecord] = []

    async def session(self, session: Session, num_turns: int) -> None:
        messages = list(session.history)
        context_tokens = session.history_tokens
        for turn_index, turn in enumerate(session.turns[:num_turns]):
            if turn_index and (time.perf_counter() >= self.deadline):
                return
            messages.append({"role": "user", "content": turn.user_text})
            context_tokens += turn.user_tokens
            reply = await self._send(messages, turn.max_tokens, context_tokens, session.index, turn_index)
            if reply is None:
                return
            messages.append({"role": "assistant", "content": reply[0]})
            context_tokens += reply[1]
            if self.spec.think_time and turn_index + 1 < num_turns:
                await asyncio.sleep(self.spec.think_time)

    async def _send(
        self, messages: list[dict], max_tokens: int, input_tokens: int, session: int, turn: int
    ) -> tuple[str, int] | None:
        """Send one turn; returns (answer text, output tokens), or None if it failed."""
        if self.limit is not None:
            await self.limit.acquire()
        try:
            request_id = self.next_id
            self.next_id += 1
            reply = await self.client.send(
                list(messages),
                max_tokens,
                input_tokens,
                self.clock,
                request_id,
                warmup=request_id < self.spec.warmup,
                session=session,
                turn=turn,
            )
        finally:
            if self.limit is not None:
                self.limit.release()
        self.records.append(reply.record)
        self.on_record(reply.record)
        return (reply.text, reply.record.output_tokens) if reply.record.ok else None


async def run_load(
    spec: LoadSpec,
    workload: SessionFactory,
    client: StreamingClient,
    on_record: Callable[[RequestRecord], None] = lambda record: None,
) -> LoadResult:
    """Offer one level of load and wait for every request it started.

    A failed turn ends its session (there is no answer to continue the conversation from).
    """
    run = _Run(spec, client, on_record)
    total = spec.num_requests + spec.warmup if spec.num_requests is not None else math.inf
    turns = workload.turns_per_session
    claimed = {"requests": 0, "sessions": 0}

    def claim() -> tuple[Session, int] | None:
        """The next session and how many of its turns fit in the request budget."""
        if claimed["requests"] >= total or time.perf_counter() >= run.deadline:
            return None
        num_turns = int(min(turns, total - claimed["requests"]))
        claimed["requests"] += num_turns
        claimed["sessions"] += 1
        return workload.session(claimed["sessions"] - 1), num_turns

    if math.isinf(spec.rate) and spec.concurrency is not None:
        # Closed loop: `concurrency` users, each starting a new session when one ends.
        async def user() -> None:
            while (next_session := claim()) is not None:
                await run.session(*next_session)

        await asyncio.gather(*(user() for _ in range(spec.concurrency)))
        return LoadResult(run.records, time.perf_counter() - run.clock)

    tasks: list[asyncio.Task] = []
    next_start = run.clock
    gaps = interarrival_times(spec.rate, random.Random(spec.seed), spec.arrival, spec.burstiness)
    while True:
        delay = next_start - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        next_session = claim()
        if next_session is None:
            break
        tasks.append(asyncio.create_task(run.session(*next_session)))
        next_start += next(gaps)
        await asyncio.sleep(0)  # let the new session send before scheduling the next arrival
    await asyncio.gather(*tasks)
    return LoadResult(run.records, time.perf_counter() - run.clock)
