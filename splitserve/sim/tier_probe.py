"""Measure the tiers around the engine for `sim calibrate --engine URL --out FILE`, through
their public HTTP APIs (standard library only):

- `--render URL`: the render tier's time per request, as the proxy waits for it: POST
  /v1/completions/render of prompts of several lengths, wall time on the client (HTTP
  included: the proxy pays the same hop), the fastest of `repeats` kept; a line fitted to
  (prompt tokens, seconds) gives the cost per request and per prompt token.
- `--pd URL`: a P/D proxy's handoff. Requests of several prompt lengths go through its
  /v1/completions (one output token each); the proxy times every first token on both paths
  and keeps what the remote path spends beyond the local one (router/pd_costs.py), which
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

import numpy as np

from splitserve.sim.calibrate import CalibrationError
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
