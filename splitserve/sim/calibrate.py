"""Fit the roofline's efficiency factors to measured step times.

Input (JSON): a list of samples, or {"samples": [...], "model": ..., "gpu": ...}. A sample:
  {"kind": "prefill", "num_tokens": N, "context_len": PAST, "step_time_s": T}
  {"kind": "decode", "batch_size": B, "context_len": CTX, "step_time_s": T}
context_len is the cached past for a prefill, the mean context per sequence for a decode
step ("num_tokens" is accepted for the batch size of a decode step).

Model: t = max(FLOPs / (peak * compute), bytes / (bandwidth * bw)) + overhead. The fit
alternates between deciding which bound each sample sits on and a linear least-squares
fit of (1/compute, 1/bw, overhead) on those assignments, until they stop changing.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np

from splitserve.sim.roofline import Efficiency, Roofline


class CalibrationError(ValueError):
    pass


class Sample(NamedTuple):
    kind: str
    tokens: int  # prefill: new tokens; decode: batch size
    context: int
    step_s: float


class Fit(NamedTuple):
    eff: Efficiency
    samples: int
    compute_bound: int
    rms_rel_error: float
    max_rel_error: float


def parse_samples(data: object) -> tuple[list[Sample], dict]:
    meta: dict = {}
    if isinstance(data, dict):
        meta = {k: v for k, v in data.items() if k != "samples"}
        data = data.get("samples")
    if not isinstance(data, list) or not data:
        raise CalibrationError('expected a non-empty list of samples (or {"samples": [...]})')
    out = []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise CalibrationError(f"sample {i}: expected an object")
        kind = row.get("kind")
        if kind not in ("prefill", "decode"):
            raise CalibrationError(f"sample {i}: kind must be 'prefill' or 'decode'")
        size = row.get("batch_size", row.get("num_tokens")) if kind == "decode" else row.get("num_tokens")
        try:
            tokens, context = int(size), int(row.get("context_len", 0))
            step = float(row["step_time_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(
                f"sample {i}: needs numeric num_tokens/batch_size and step_time_s"
            ) from exc
        if tokens < 1 or context < 0 or not step > 0:
            raise CalibrationError(f"sample {i}: sizes must be >= 1, context >= 0, step_time_s > 0")
        out.append(Sample(kind, tokens, context, step))
    return out, meta


def load_samples(path: str) -> tuple[list[Sample], dict]:
    try:
        with open(path) as f:
            return parse_samples(json.load(f))
    except FileNotFoundError as exc:
        raise CalibrationError(f"{path}: no such file") from exc
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc})") from exc


def _features(rl: Roofline, samples: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: seconds at 100% of peak FLOP/s, seconds at 100% of peak bandwidth."""
    f, b = [], []
    for s in samples:
        cost = (
            rl.prefill(s.tokens, past=s.context)
            if s.kind == "prefill"
            else rl.decode(s.tokens, s.tokens * s.context)
        )
        f.append(cost.flops / (rl.gpu.peak_flops * rl.tp))
        b.append(cost.bytes / (rl.gpu.mem_bw * rl.tp))
    return np.array(f), np.array(b)


def fit(rl: Roofline, samples: list[Sample], iters: int = 50) -> Fit:
    if len(samples) < 3:
        raise CalibrationError("need at least 3 samples")
    f, b = _features(rl, samples)
    t = np.array([s.step_s for s in samples])
    compute = f > b  # first guess: the side of the ridge at peak
    x, y, o = 1 / 0.5, 1 / 0.75, 0.0
    for _ in range(iters):
        cols = [np.where(compute, f, 0.0), np.where(compute, 0.0, b), np.ones_like(t)]
        a = np.stack(cols, axis=1)
        keep = [i for i in range(3) if np.any(a[:, i])]
        coef, *_ = np.linalg.lstsq(a[:, keep] / t[:, None], np.ones_like(t), rcond=None)  # relative errors
        full = dict(zip(keep, coef, strict=True))
        x, y, o = full.get(0, x), full.get(1, y), full.get(2, 0.0)
        if o < 0:  # no negative overhead: refit without it
            keep2 = [i for i in keep if i != 2]
            coef, *_ = np.linalg.lstsq(a[:, keep2] / t[:, None], np.ones_like(t), rcond=None)
            full = dict(zip(keep2, coef, strict=True))
            x, y, o = full.get(0, x), full.get(1, y), 0.0
        new = f * x > b * y
        if np.array_equal(new, compute):
            break
        compute = new
    pred = np.maximum(f * x, b * y) + o
    rel = np.abs(pred - t) / t
    eff = Efficiency(compute=float(min(1.0, 1 / x)), bandwidth=float(min(1.0, 1 / y)), overhead_s=float(o))
    return Fit(eff, len(samples), int(compute.sum()), float(np.sqrt(np.mean(rel**2))), float(rel.max()))


def synthetic_samples(rl: Roofline, eff: Efficiency, noise: float = 0.02, seed: int = 0) -> list[Sample]:
    """Step times a GPU running at `eff` would report (for testing the fit)."""
    rng = np.random.default_rng(seed)
    truth = Roofline(rl.model, rl.gpu, eff, tp=rl.tp)
    out = []
    for n, past in [(128, 0), (512, 0), (1024, 1024), (2048, 0), (2048, 4096), (4096, 0), (8192, 0)]:
        out.append(Sample("prefill", n, past, truth.step_s(truth.prefill(n, past))))
    for batch, ctx in [(1, 512), (1, 8192), (8, 2048), (32, 1024), (64, 4096), (128, 1024)]:
        out.append(Sample("decode", batch, ctx, truth.step_s(truth.decode(batch, batch * ctx))))
    return [s._replace(step_s=s.step_s * (1 + noise * rng.standard_normal())) for s in out]


def samples_to_json(samples: list[Sample]) -> list[dict]:
    rows = []
    for s in samples:
        size_key = "num_tokens" if s.kind == "prefill" else "batch_size"
        rows.append({"kind": s.kind, size_key: s.tokens, "context_len": s.context, "step_time_s": s.step_s})
    return rows
