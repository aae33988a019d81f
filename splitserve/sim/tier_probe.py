"""Measure the tiers around the engine for `sim calibrate --engine URL --out FILE`, through
their public HTTP APIs (standard library only):

- `--render URL`: the render tier's time per request, as the proxy waits for it: POST
  /v1/completions/render of prompts of several lengths, wall time on the client (HTTP
  included: the proxy pays the same hop), the fastest of `repeats` kept; a line fitted to
  (prompt tokens, seconds) gives the cost per request and per prompt token.
- `--proxy URL`: the serving path around the engine (`splitserve serve`, or `up`'s proxy):
  OpenAI /v1/completions. Per request: the client's time to a one-token answer of a short
  prompt beyond its prefill step (the step model's) and the render tier's cost. Per
  streamed token: the CPU time the serving path takes from the engine's cores for each
  token (sim/engine.py adds it to every step, per token the step streams): what a stream
  alone adds to its step's time, and what 8 concurrent ones add per token beyond the
  batch-8 step (gap = step + 8c); the larger of the two, 0 where the steps set the pace.
- `--pd URL`: a P/D proxy's handoff. Requests of several prompt lengths go through its
  /v1/completions (one output token each; short ones first, which stay on decode); the
  proxy times every first token on both paths and keeps what the remote path spends
  beyond the local one (router/pd_costs.py), which
  `GET /workers` reports; that measured `handoff_fixed_s` is the profile's fixed cost. The
  cost per byte is what remote first tokens grow by per prompt byte of KV beyond the
  prefill compute the step model predicts (0 when not measurably above it).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.engine_probe import run_together
from splitserve.sim.profile import CpuCosts
from splitserve.sim.step_model import StepModel

_WORDS = ("alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike")


def _post(url: str, body: dict | None, timeout_s: float) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:200]
        raise CalibrationError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CalibrationError(f"{url}: cannot reach it or not JSON ({exc})") from None


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clamped at 0."""
    slope, intercept = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    if slope < 0:
        return float(max(0.0, np.mean(ys))), 0.0
    return float(max(0.0, intercept)), float(slope)


def measure_render(
    url: str, words: Sequence[int] = (16, 128, 512, 1024), repeats: int = 3, timeout_s: float = 60.0
) -> CpuCosts:
    base = url.rstrip("/") + "/v1/completions/render"
    rng = random.Random(0)
    _post(base, {"prompt": "warm up"}, timeout_s)
    tokens, seconds = [], []
    for n in words:
        best, count = float("inf"), 0
        for _ in range(repeats):
            text = " ".join(rng.choice(_WORDS) for _ in range(n))
            start = time.perf_counter()
            out = _post(base, {"prompt": text}, timeout_s)
            best = min(best, time.perf_counter() - start)
            try:
                count = len(out[0]["token_ids"])  # type: ignore[index]
            except (KeyError, IndexError, TypeError):
                raise CalibrationError(f"{base}: the answer carries no token_ids") from None
        tokens.append(count)
        seconds.append(best)
    per_request, per_token = _line(tokens, seconds)
    return CpuCosts(per_request, per_token)


def _stream_gap_s(url: str, prompt: list[int], max_tokens: int, timeout_s: float) -> float:
    """A streamed completion's mean gap between its first and last events, per token."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    times: list[float] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    times.append(time.perf_counter())
    except (urllib.error.URLError, OSError) as exc:
        raise CalibrationError(f"{url}: cannot stream from it ({exc})") from None
    if len(times) < 2:
        raise CalibrationError(f"{url}: a {max_tokens}-token stream came in fewer than two events")
    return (times[-1] - times[0]) / (max_tokens - 1)


class ServingPathCosts(NamedTuple):
    per_request_s: float
    per_step_s: float
    per_token_s: float


def measure_serving_path(
    url: str,
    steps: StepModel,
    render: CpuCosts | None,
    repeats: int = 3,
    prompt_tokens: int = 32,
    stream_tokens: int = 48,
    batch: int = 8,
    timeout_s: float = 120.0,
) -> ServingPathCosts:
    """What the path around the engine costs per request, per step and per streamed token."""
    base = url.rstrip("/") + "/v1/completions"
    rng = random.Random(2)

    def prompt() -> list[int]:
        return [rng.randrange(10, 250) for _ in range(prompt_tokens)]

    _post(base, {"prompt": prompt(), "max_tokens": 2}, timeout_s)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _post(base, {"prompt": prompt(), "max_tokens": 1, "temperature": 0}, timeout_s)
        best = min(best, time.perf_counter() - start)
    before_engine = render.delay_s(prompt_tokens) if render is not None else 0.0
    per_request = max(0.0, best - steps.prefill_s(prompt_tokens) - before_engine)
    context = prompt_tokens + stream_tokens // 2
    alone = min(_stream_gap_s(base, prompt(), stream_tokens, timeout_s) for _ in range(repeats))
    together = float("inf")
    for _ in range(repeats):
        gaps: list[float] = []

        def one(gaps: list[float] = gaps) -> None:
            gaps.append(_stream_gap_s(base, prompt(), stream_tokens, timeout_s))

        run_together(one, batch)
        together = min(together, sorted(gaps)[len(gaps) // 2])
    step_alone = float(steps.decode_s(1, context))
    step_together = float(steps.decode_s(batch, batch * context))
    # The tiers share the engine's cores (sim/engine.py): what the serving path spends on a
    # step's tokens is taken from the engine, so a stream's gap is its step plus that time,
    # gap(B) = step(B) + s + B c: a cost per step that streams (the path's wakeup, the
    # batch's hops) and one per token. One stream and `batch` concurrent ones give the two
    # points; at B = 1 the whole excess is s + c (one stream's whole gap taken as the
    # per-token cost once priced every token of a big batch at a lone stream's).
    excess_alone = max(0.0, alone - step_alone)
    excess_together = max(0.0, together - step_together)
    per_token = max(0.0, (excess_together - excess_alone) / (batch - 1))
    return ServingPathCosts(per_request, max(0.0, excess_alone - per_token), per_token)


def measure_handoff(
    url: str,
    steps: StepModel,
    kv_bytes_per_token: int,
    prompt_tokens: Sequence[int] = (256, 1024, 2048),
    repeats: int = 3,
    timeout_s: float = 120.0,
) -> tuple[float, float]:
    """(fixed seconds, seconds per KV byte) of the P/D handoff."""
    base = url.rstrip("/")
    rng = random.Random(1)
    for _ in range(repeats):  # short prompts stay on decode: the proxy's local fixed cost
        body = {"prompt": [rng.randrange(10, 250) for _ in range(16)], "max_tokens": 1, "temperature": 0}
        _post(base + "/v1/completions", body, timeout_s)
    sizes, excess = [], []
    for n in prompt_tokens:
        best = float("inf")
        for _ in range(repeats):
            body = {"prompt": [rng.randrange(10, 250) for _ in range(n)], "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            _post(base + "/v1/completions", body, timeout_s)
            best = min(best, time.perf_counter() - start)
        sizes.append(n * kv_bytes_per_token)
        excess.append(best - steps.prefill_s(n))
    costs = _post(base + "/workers", None, timeout_s)
    try:
        fixed = float(costs["pd_costs"]["measured"]["handoff_fixed_s"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(
            f"{base}/workers reports no measured handoff: is it a P/D proxy, and did any request go remote?"
        ) from None
    _, per_byte = _line(sizes, excess)
    return fixed, per_byte
