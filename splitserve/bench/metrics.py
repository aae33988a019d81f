"""Per-request records and the metrics computed from them.

Definitions (all times in seconds, measured by the client with `time.perf_counter`):

- **TTFT** (time to first token): from just before the request is sent to the arrival of
  the first streamed chunk that carries output (text, reasoning or a tool call). Chunks
  that carry nothing (the role-only first chat chunk, the usage chunk) do not count.
- **E2E** (end-to-end latency): from just before the request is sent to the arrival of the
  last chunk that carries output, i.e. when the user has the whole answer.
- **Gap** / **ITL** (inter-token latency): the time between two consecutive output chunks
  of one request. A request with k output chunks has k - 1 gaps, and they sum to
  E2E - TTFT exactly. A server that packs several tokens into one chunk shows one gap for
  them (what the user sees), as in vLLM's `bench serve`.
- **TPOT** (time per output token): (E2E - TTFT) / (output tokens - 1), the average pace
  after the first token; 0 for a one-token answer (vLLM's convention).
- **Worst gap**: a request's longest gap, the stall the user notices. An average (TPOT)
  hides it; a worst-gap target (`gap=100ms`) exposes it.
- **Output tokens**: the server's `usage.completion_tokens` when it sends usage
  (`stream_options.include_usage`), else the tokens of the streamed text counted with the
  local tokenizer, else the number of output chunks.
- **Throughput**: completed requests (or tokens) divided by the measured window: from the
  first measured request's send to the last measured request's end. Warm-up requests are
  excluded from every metric.
- **SLO attainment** for a target such as `ttft=2s,tpot=30ms,gap=100ms`: the fraction of
  measured requests that succeeded and met every bound of the target. Failed requests
  count as misses.
- **Goodput (vLLM)**: requests meeting the target per second of the measured window, at
  this load (vLLM `bench serve --goodput`).
- **Goodput (DistServe)**: over a sweep of offered rates, the highest rate whose
  attainment is at least the required fraction (default 90%), as in the DistServe paper
  and the seed's table; 0 when no rate reaches it.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from splitserve.goodput import SLO


class RequestRecord(NamedTuple):
    """One request as the client saw it. `chunk_times` are the arrival times of the output
    chunks, relative to `start`; the first is the TTFT, the last the E2E."""

    request_id: int
    start: float  # seconds since the run's clock started
    chunk_times: tuple[float, ...]
    input_tokens: int
    output_tokens: int
    error: str | None = None
    warmup: bool = False
    session: int = 0
    turn: int = 0
    # the server's phases for this request (`splitserve_timeline`, splitserve servers only)
    timeline: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def worst_gap(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def tpot(self) -> float:
        if not self.chunk_times or self.output_tokens <= 1:
            return 0.0
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def end(self) -> float:
        """When the request finished, on the run's clock (its start if nothing came back)."""
        return self.start + (self.chunk_times[-1] if self.chunk_times else 0.0)

    def metric_values(self) -> dict[str, float | None]:
        """The values an SLO bounds (splitserve.goodput.SLO_KEYS); None when nothing came back."""
        gaps = self.gaps
        return {
            "ttft": self.ttft,
            "tpot": self.tpot if self.chunk_times else None,
            "gap": self.worst_gap if self.chunk_times else None,
            "p99_itl": float(np.percentile(gaps, 99)) if gaps else 0.0,
            "e2e": self.e2e,
        }

    def meets(self, slo: SLO) -> bool:
        """Succeeded and met every bound of `slo`."""
        return self.ok and bool(slo.met(self.metric_values()))

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "session": self.session,
            "turn": self.turn,
            "warmup": self.warmup,
            "start": self.start,
            "error": self.error,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "ttft": self.ttft,
            "tpot": self.tpot if self.ok else None,
            "worst_gap": self.worst_gap if self.ok else None,
            "e2e": self.e2e,
            "chunk_times": list(self.chunk_times),
            "timeline": self.timeline,
        }

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        return cls(
            request_id=int(data["request_id"]),
            start=float(data["start"]),
            chunk_times=tuple(float(t) for t in data["chunk_times"]),
            input_tokens=int(data["input_tokens"]),
            output_tokens=int(data["output_tokens"]),
            error=data.get("error"),
            warmup=bool(data.get("warmup", False)),
            session=int(data.get("session", 0)),
            turn=int(data.get("turn", 0)),
            timeline=data.get("timeline") if isinstance(data.get("timeline"), dict) else None,
        )


class Distribution(NamedTuple):
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan)
        array = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(array, [50, 90, 99])
        return cls(len(array), float(array.mean()), float(p50), float(p90), float(p99), float(array.max()))


class RunSummary(NamedTuple):
    """Aggregate metrics of one load level (warm-up excluded)."""

    rate: float  # offered arrival rate, req/s (inf: all at once)
    concurrency: int | None
    requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # error kind -> count
    duration: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    worst_gap: Distribution
    e2e: Distribution
    attainment: dict[str, float]  # SLO name -> fraction of measured requests meeting it
    goodput: dict[str, float]  # SLO name -> good requests per second (vLLM's definition)

    def to_json(self) -> dict:
        data = self._asdict()
        for key in ("ttft", "tpot", "itl", "worst_gap", "e2e"):
            data[key] = data[key]._asdict()
        return data


def error_kind(error: str) -> str:
    """The part of an error message before the first ':' ('HTTP 500: ...' -> 'HTTP 500')."""
    return error.split(":", 1)[0].strip()


def measured_window(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def summarize(
    records: Iterable[RequestRecord], slos: Sequence[SLO], rate: float, concurrency: int | None = None
) -> RunSummary:
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    duration = measured_window(measured)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    good = {s.name: sum(r.meets(s) for r in measured) for s in slos}
    attainment = {name: (count / len(measured) if measured else 0.0) for name, count in good.items()}
    goodput = {name: per_second(count) for name, count in good.items()}
    return RunSummary(
        rate=rate,
        concurrency=concurrency,
        requests=len(measured),
        completed=len(ok),
        failed=len(measured) - len(ok),
        errors=dict(Counter(error_kind(r.error) for r in measured if r.error is not None)),
        duration=duration,
        request_throughput=per_second(len(ok)),
        input_throughput=per_second(sum(r.input_tokens for r in ok)),
        output_throughput=per_second(sum(r.output_tokens for r in ok)),
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Distribution.of([r.tpot for r in ok if r.output_tokens > 1]),
        itl=Distribution.of([gap for r in ok for gap in r.gaps]),
        worst_gap=Distribution.of([r.worst_gap for r in ok]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        attainment=attainment,
        goodput=goodput,
    )
