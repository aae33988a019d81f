"""The serving path's share of each streamed token: every token the engines emit passes
through the tiers in front of them (the proxy, the render tier's detokenizing, the OpenAI
server's stream), which a profile measures as a fixed service time per token. Modelled as
one first-come-first-served server with that service time: at low load it adds `c` to each
token; once tokens arrive faster than 1/c per second, a queue builds and the streams wait
for it (what a measured stack on few cores does, and the engine's step times alone miss).

Lindley's recursion, depart_i = max(arrive_i, depart_{i-1}) + c, over all tokens in time
order, in closed form: depart_i = (i + 1)·c + max_{j <= i}(arrive_j - j·c).
"""

from __future__ import annotations

import numpy as np


def through_serving_path(token_times: list[np.ndarray], s_per_token: float) -> list[np.ndarray]:
    """Each request's token times as the client sees them, after the shared serving path."""
    if s_per_token <= 0:
        return token_times
    sizes = [len(t) for t in token_times]
    if not sum(sizes):
        return token_times
    flat = np.concatenate(token_times)
    order = np.argsort(flat, kind="stable")
    index = np.arange(len(flat))
    depart_sorted = (index + 1) * s_per_token + np.maximum.accumulate(flat[order] - index * s_per_token)
    depart = np.empty_like(flat)
    depart[order] = depart_sorted
    return list(np.split(depart, np.cumsum(sizes)[:-1]))
