"""How long the attention side waits for one layer's answer before it takes the FFN daemon
for stuck (alive but silent: SIGSTOPped, wedged) and sends the layer again on a new
connection.

The deadline follows what the daemon measured: every answer carries the daemon's compute
of that layer (`compute_s`), and the client sees the whole round trip. A layer of `T`
tokens is expected to take the slowest recent round trip plus the slowest recent compute
per token times `T` (so a long prefill chunk after many decode steps is given its time);
the deadline is `factor` times that, never under `floor_s` (a shared machine's scheduling
hiccups are not a stuck daemon) and never over the client's whole timeout. Before any
layer has been answered there is nothing to go by: the whole timeout.
"""

from __future__ import annotations

from collections import deque

DEADLINE_FLOOR_S = 2.0
DEADLINE_FACTOR = 8.0
RECENT_LAYERS = 64  # the answers the estimate looks at (a daemon gets slower under load)


class ReplyDeadline:
    def __init__(
        self, timeout_s: float, floor_s: float = DEADLINE_FLOOR_S, factor: float = DEADLINE_FACTOR
    ) -> None:
        if not 0 < floor_s <= timeout_s:
            raise ValueError(f"the deadline floor must be in (0, {timeout_s}] s, not {floor_s}")
        self.timeout_s, self.floor_s, self.factor = timeout_s, floor_s, factor
        self.round_trips: deque[float] = deque(maxlen=RECENT_LAYERS)
        self.compute_per_token: deque[float] = deque(maxlen=RECENT_LAYERS)

    def observe(self, round_trip_s: float, compute_s: float, num_tokens: int) -> None:
        """One answered layer: its round trip as the client saw it, the daemon's compute."""
        self.round_trips.append(max(0.0, round_trip_s))
        self.compute_per_token.append(max(0.0, compute_s) / max(1, num_tokens))

    def for_layer(self, num_tokens: int) -> float:
        """Seconds to wait for the answer to a layer of `num_tokens` tokens."""
        if not self.round_trips:
            return self.timeout_s
        expected = max(self.round_trips) + max(self.compute_per_token) * num_tokens
        return min(self.timeout_s, max(self.floor_s, self.factor * expected))
