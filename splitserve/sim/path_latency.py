"""A request's way to the engine and its tokens' way back, fitted from a bench run of the
layout (`sim retime --bench RUN.json`).

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

Each later token takes a way back of its own: `up`'s service derenders it through the
render tier (a batched HTTP call) and sends it, one token after the other per stream, so a
token leaves no earlier than the one before it has, and the client's gap is the engine's
gap plus the difference of two relay times. In one run the derender and send phases came to
3.3 ms a token at 4 req/s and 12.3 at 16 (docs/sim.md), as long as a decode step. The relay
per token is fitted the same way, from each request's derender and send phases over its
tokens against the streams in flight at its first token (itself included):

    relay = relay_fixed + a random wait of mean relay_per_in_flight * (streams in flight)

The fixed part is the round trip with nothing else in flight; the random part, the waits of
its two queues on shared cores (a free derender call, the render tier's turn on a core), is
drawn as a gamma of shape 2: the sum of two exponential waits. With `serve`, which
detokenizes in process, both come to ~0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from splitserve.protocol.timeline import DECODE_FIRST_STEP, DERENDER, HANDOFF, PREFILL, PREFILL_QUEUE, SEND

# the phases before a first token the simulator times itself
SIMULATED_PHASES = (PREFILL_QUEUE, PREFILL, HANDOFF, DECODE_FIRST_STEP)
MIN_REQUESTS = 20  # timed requests a fit needs
RELAY_SHAPE = 2.0  # the gamma's shape of a token's random relay wait (module doc)
FIELDS = ("fixed_s", "per_in_flight_s", "relay_fixed_s", "relay_per_in_flight_s", "requests")


class PathLatency(NamedTuple):
    fixed_s: float
    per_in_flight_s: float
    relay_fixed_s: float  # a later token's way back with nothing else in flight
    relay_per_in_flight_s: float  # the mean of its random wait, per stream in flight
    requests: int  # the timed requests it was fitted on

    def delay_s(self, in_flight: int) -> float:
        return self.fixed_s + self.per_in_flight_s * in_flight

    def delivered(self, emitted: np.ndarray, streams: int, rng: np.random.Generator) -> np.ndarray:
        """When a stream's tokens, emitted by its engine at `emitted`, reach the client through
        the relay with `streams` in flight (module doc), shifted so that the first arrives as
        emitted: the path already holds the first token's way back."""
        mean = self.relay_per_in_flight_s * streams
        relay = np.full(len(emitted), self.relay_fixed_s)
        if mean > 0:
            relay += rng.gamma(RELAY_SHAPE, mean / RELAY_SHAPE, len(emitted))
        out = np.empty(len(emitted))
        left = -np.inf
        for k, (t, r) in enumerate(zip(emitted, relay, strict=True)):
            left = max(t, left) + r
            out[k] = left
        return out - relay[0] if len(out) else out

    @classmethod
    def from_json(cls, data: object, source: str) -> PathLatency:
        """ValueError naming what is wrong."""
        if not isinstance(data, dict) or set(data) != set(FIELDS):
            raise ValueError(f"{source}: needs exactly {', '.join(FIELDS)}")
        values = [data[name] for name in FIELDS]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in values):
            raise ValueError(f"{source}: every field must be a number >= 0")
        return cls(*(float(v) for v in values[:-1]), int(values[-1]))


class TimedRequest(NamedTuple):
    in_flight: int  # the run's other requests sent before it and not yet answered
    path_s: float
    streams: int  # the run's requests streaming as its first token came, itself included
    relay_s: float  # its derender and send phases per token


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
                first = start + q["ttft"]
                streams = int(np.sum((starts < first) & (ends >= first)))
                way_back = (timeline.get(DERENDER) or 0.0) + (timeline.get(SEND) or 0.0)
                relay = way_back / max(1, q["output_tokens"])
                out.append(TimedRequest(in_flight, max(0.0, q["ttft"] - simulated), streams, relay))
        return out
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a `splitserve bench --json` run ({exc!r} missing or malformed)") from None


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of y on x by least squares, neither negative: a negative slope
    gives the mean, a negative intercept the line through the origin."""
    if np.ptp(x) > 0:
        slope, fixed = np.polyfit(x, y, 1)
    else:
        slope, fixed = 0.0, float(np.mean(y))
    if slope < 0:
        slope, fixed = 0.0, float(np.mean(y))
    if fixed < 0:
        fixed, slope = 0.0, max(0.0, float(np.sum(x * y) / np.sum(x * x)))
    return float(fixed), float(slope)


def fit_path_latency(run: dict) -> PathLatency:
    """The path's latency and the tokens' relay fitted on `run`'s timed requests (module
    doc); ValueError when it has fewer than MIN_REQUESTS of them."""
    timed = timed_requests(run)
    if len(timed) < MIN_REQUESTS:
        raise ValueError(
            f"{len(timed)} request(s) with the server's timeline (at least {MIN_REQUESTS}: "
            "a bench run of `up` or `serve`, which time their phases)"
        )
    path = fit_line(np.array([t.in_flight for t in timed], dtype=float), np.array([t.path_s for t in timed]))
    relay = fit_line(np.array([t.streams for t in timed], dtype=float), np.array([t.relay_s for t in timed]))
    return PathLatency(*path, *relay, len(timed))


def path_row(path: PathLatency) -> str:
    return (
        f"path to the engines and back: {path.fixed_s * 1e3:.2f} ms + {path.per_in_flight_s * 1e3:.3f} ms "
        f"per request in flight; each later token's relay {path.relay_fixed_s * 1e3:.2f} ms + "
        f"{path.relay_per_in_flight_s * 1e3:.3f} ms per stream ({path.requests} requests)"
    )
