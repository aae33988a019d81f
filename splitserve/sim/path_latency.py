"""A request's way to the engine and its first token's way back, fitted from a bench run of
the layout (`sim retime --bench RUN.json`).

The simulator times what the engines do before a first token: the prompt's queue, its
prefill, the KV handoff and decode's first step. The rest of a client's time to first token
is the path around them: the render tier, the proxy's routing and hops, the connection and
the client itself. `sim calibrate` measures that path on an idle stack (a few ms); on a
host whose cores the path's processes share with busy engines it grows with the load (one
run: 12 ms at a median of 1.5 requests in flight, 31 ms at 19; docs/sim.md). From a
`splitserve bench --json` run whose server timed its phases (`splitserve_timeline`), each
request's path is its time to first token less the phases the simulator times, and the
fit is least squares on the requests in flight when it was sent:

    path = fixed + per_in_flight * (requests in flight)

which the simulator adds before each request reaches an engine, with the requests in
flight in the simulation at its arrival.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from splitserve.protocol.timeline import DECODE_FIRST_STEP, HANDOFF, PREFILL, PREFILL_QUEUE

# the phases before a first token the simulator times itself
SIMULATED_PHASES = (PREFILL_QUEUE, PREFILL, HANDOFF, DECODE_FIRST_STEP)
MIN_REQUESTS = 20  # timed requests a fit needs
FIELDS = ("fixed_s", "per_in_flight_s", "requests")


class PathLatency(NamedTuple):
    fixed_s: float
    per_in_flight_s: float
    requests: int  # the timed requests it was fitted on

    def delay_s(self, in_flight: int) -> float:
        return self.fixed_s + self.per_in_flight_s * in_flight

    @classmethod
    def from_json(cls, data: object, source: str) -> PathLatency:
        """ValueError naming what is wrong."""
        if not isinstance(data, dict) or set(data) != set(FIELDS):
            raise ValueError(f"{source}: needs exactly {', '.join(FIELDS)}")
        values = [data[name] for name in FIELDS]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in values):
            raise ValueError(f"{source}: every field must be a number >= 0")
        return cls(float(values[0]), float(values[1]), int(values[2]))


class TimedRequest(NamedTuple):
    in_flight: int  # the run's other requests sent before it and not yet answered
    path_s: float


def timed_requests(run: dict) -> list[TimedRequest]:
    """Each answered request of a bench run (`splitserve bench --json`) whose server timed
    its phases; ValueError when the run is not one."""
    try:
        levels = run["levels"]
        out = []
        for level in levels:
            answered = [q for q in level["requests"] if q.get("error") is None and q.get("ttft")]
            starts = np.array([q["start"] for q in answered], dtype=float)
            ends = starts + np.array([q["e2e"] for q in answered], dtype=float)
            for q, start in zip(answered, starts, strict=True):
                timeline = q.get("timeline")
                if not timeline:
                    continue
                simulated = sum(timeline.get(name) or 0.0 for name in SIMULATED_PHASES)
                in_flight = int(np.sum((starts < start) & (ends > start)))
                out.append(TimedRequest(in_flight, max(0.0, q["ttft"] - simulated)))
        return out
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a `splitserve bench --json` run ({exc!r} missing or malformed)") from None


def fit_path_latency(run: dict) -> PathLatency:
    """The path's latency fitted on `run`'s timed requests (module doc); ValueError when it
    has fewer than MIN_REQUESTS of them. A negative slope or intercept is pinned at 0."""
    timed = timed_requests(run)
    if len(timed) < MIN_REQUESTS:
        raise ValueError(
            f"{len(timed)} request(s) with the server's timeline (at least {MIN_REQUESTS}: "
            "a bench run of `up` or `serve`, which time their phases)"
        )
    x = np.array([t.in_flight for t in timed], dtype=float)
    y = np.array([t.path_s for t in timed])
    if np.ptp(x) > 0:
        slope, fixed = np.polyfit(x, y, 1)
    else:
        slope, fixed = 0.0, float(np.mean(y))
    if slope < 0:
        slope, fixed = 0.0, float(np.mean(y))
    if fixed < 0:
        fixed, slope = 0.0, max(0.0, float(np.sum(x * y) / np.sum(x * x)))
    return PathLatency(float(fixed), float(slope), len(timed))


def path_row(path: PathLatency) -> str:
    return (
        f"path to the engines and back: {path.fixed_s * 1e3:.2f} ms + {path.per_in_flight_s * 1e3:.3f} ms "
        f"per request in flight ({path.requests} requests)"
    )
