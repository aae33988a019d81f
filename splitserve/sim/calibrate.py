"""Fit the roofline's efficiency factors to measured step times.

Input (JSON): a list of samples, or {"samples": [...], "model": ..., "gpu": ...}. A sample:
  {"kind": "prefill", "num_tokens": N, "context_len": PAST, "step_time_s": T}
  {"kind": "decode", "batch_size": B, "context_len": CTX, "step_time_s": T}
  {"kind": "mixed", "num_tokens": N, "batch_size": B, "context_len": CTX, "step_time_s": T}
context_len is the cached past for a prefill, the mean context per sequence for a decode
step ("num_tokens" is accepted for the batch size of a decode step). A mixed step prefills
a prompt of N tokens beside a decode batch of B at CTX each; the step model prices it (the
roofline fit leaves it out).

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
    kind: str  # "prefill", "decode", or "mixed": a prefill chunk beside a decode batch
    tokens: int  # prefill and mixed: new prompt tokens; decode: batch size
    context: int
    step_s: float
    batch: int = 0  # mixed: the decode batch beside the chunk


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
        if kind not in ("prefill", "decode", "mixed"):
            raise CalibrationError(f"sample {i}: kind must be 'prefill', 'decode' or 'mixed'")
        size = row.get("batch_size", row.get("num_tokens")) if kind == "decode" else row.get("num_tokens")
        try:
            tokens, context = int(size), int(row.get("context_len", 0))
            step = float(row["step_time_s"])
            batch = int(row["batch_size"]) if kind == "mixed" else 0
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(
                f"sample {i}: needs numeric num_tokens/batch_size and step_time_s"
                + (" (a mixed step both)" if kind == "mixed" else "")
            ) from exc
        if tokens < 1 or context < 0 or not step > 0 or (kind == "mixed" and batch < 1):
            raise CalibrationError(f"sample {i}: sizes must be >= 1, context >= 0, step_time_s > 0")
        out.append(Sample(kind, tokens, context, step, batch))
    return out, meta


def load_samples(path: str) -> tuple[list[Sample], dict]:
    try:
        with open(path) as f:
            return parse_samples(json.load(f))
    except FileNotFoundError as exc:
        raise CalibrationError(f"{path}: no such file") from exc
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc})") from exc


def _features(rl: Roofline, samples: list[Sample]) -> dict[str, np.ndarray]:
    """Per sample: seconds of linear (and decode attention) work at 100% of peak FLOP/s, of
    prefill attention at peak, of memory traffic at peak bandwidth; sequences in the step."""
    cols: dict[str, list[float]] = {"lin": [], "attn": [], "bytes": [], "kv": [], "seqs": [], "fill": []}
    for s in samples:
        if s.kind == "prefill":
            cost = rl.prefill(s.tokens, past=s.context)
        else:
            cost = rl.decode(s.tokens, s.tokens * s.context)
        peak_f, peak_b = rl.gpu.peak_flops * rl.tp, rl.gpu.mem_bw * rl.tp
        cols["lin"].append((cost.linear_flops + cost.decode_attn_flops) / peak_f)
        cols["attn"].append(cost.prefill_attn_flops / peak_f)
        cols["bytes"].append(cost.weight_bytes / peak_b)
        cols["kv"].append(cost.kv_bytes / peak_b)
        cols["seqs"].append(cost.seqs)
        # one token's linear FLOPs at peak, per step with prefill tokens (small-chunk efficiency)
        cols["fill"].append(2.0 * rl.model.active_layer_params / peak_f if s.kind == "prefill" else 0.0)
    return {k: np.array(v, dtype=float) for k, v in cols.items()}


def fit(
    rl: Roofline,
    samples: list[Sample],
    attention: bool = False,
    per_seq: bool = False,
    small_chunk: bool = False,
    kv_bandwidth: bool = False,
    iters: int = 50,
) -> Fit:
    """Fit 1/compute, 1/bandwidth and the per-step overhead (and optionally a separate
    prefill-attention efficiency, a per-sequence overhead and the small-chunk tokens) on
    relative errors. The small-chunk term enters as k = tokens / compute on each prefill
    step's one-token FLOPs, so the fit stays linear."""
    samples = [s for s in samples if s.kind != "mixed"]
    if len(samples) < 3:
        raise CalibrationError("need at least 3 samples")
    x = _features(rl, samples)
    t = np.array([s.step_s for s in samples])
    free = (
        ["c", "b", "o"]
        + (["a"] if attention else [])
        + (["s"] if per_seq else [])
        + (["k"] if small_chunk else [])
        + (["v"] if kv_bandwidth else [])
    )
    compute = (x["lin"] + x["attn"]) > x["bytes"] + x["kv"]  # first guess: the side of the ridge at peak
    coef = {"c": 2.0, "b": 1.33, "a": 2.0, "o": 0.0, "s": 0.0, "k": 0.0, "v": 1.33}
    for _ in range(iters):
        coef, free = _solve(x, t, compute, free, coef)
        attn_coef = coef["a"] if "a" in free else coef["c"]
        kv_coef = coef["v"] if "v" in free else coef["b"]
        new = x["lin"] * coef["c"] + x["attn"] * attn_coef + x["fill"] * coef["k"] > (
            x["bytes"] * coef["b"] + x["kv"] * kv_coef
        )
        if np.array_equal(new, compute):
            break
        compute = new
    attn_coef = coef["a"] if "a" in free else coef["c"]
    kv_coef = coef["v"] if "v" in free else coef["b"]
    compute_s = x["lin"] * coef["c"] + x["attn"] * attn_coef + x["fill"] * coef["k"]
    pred = np.maximum(compute_s, x["bytes"] * coef["b"] + x["kv"] * kv_coef)
    pred = pred + coef["o"] + coef["s"] * x["seqs"]
    rel = np.abs(pred - t) / t
    try:
        eff = Efficiency(
            compute=float(1 / coef["c"]),
            bandwidth=float(1 / coef["b"]),
            overhead_s=float(coef["o"]),
            attention=float(1 / coef["a"]) if "a" in free else None,
            per_seq_overhead_s=float(coef["s"]),
            small_chunk_tokens=float(coef["k"] / coef["c"]),
            kv_bandwidth=float(1 / coef["v"]) if "v" in free else None,
        )
    except ValueError as exc:
        raise CalibrationError(
            f"the fit lands outside the model ({exc}): compute {1 / coef['c']:.2f}, bandwidth "
            f"{1 / coef['b']:.2f} of the spec's peaks; check the GPU spec and the samples"
        ) from exc
    return Fit(eff, len(samples), int(compute.sum()), float(np.sqrt(np.mean(rel**2))), float(rel.max()))


def _solve(x: dict[str, np.ndarray], t: np.ndarray, compute: np.ndarray, free: list[str],
           prev: dict[str, float]) -> tuple[dict[str, float], list[str]]:  # fmt: skip
    """Linear least squares on relative errors for the given bound assignment; overheads that
    come out negative are fixed at 0 and the rest refitted."""
    col = {
        "c": np.where(compute, x["lin"] + (0.0 if "a" in free else x["attn"]), 0.0),
        "a": np.where(compute, x["attn"], 0.0),
        "b": np.where(compute, 0.0, x["bytes"] + (0.0 if "v" in free else x["kv"])),
        "v": np.where(compute, 0.0, x["kv"]),
        "o": np.ones_like(t),
        "s": x["seqs"],
        "k": np.where(compute, x["fill"], 0.0),
    }
    active = [k for k in free if np.any(col[k])]
    while True:
        a = np.stack([col[k] / t for k in active], axis=1)
        sol, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        out = dict(prev, **{k: 0.0 for k in ("o", "s", "k") if k not in active})
        out.update(zip(active, (float(v) for v in sol), strict=True))
        bad = [k for k in active if out[k] < 0 and k in ("o", "s", "k", "a")]
        if not bad:
            for k in ("c", "b", "a", "v"):
                if out[k] <= 0:  # an unidentifiable efficiency keeps its last value
                    out[k] = prev[k]
            return out, free
        active.remove(bad[0])
        if bad[0] in ("o", "s", "k"):
            prev = dict(prev, **{bad[0]: 0.0})
        else:  # no separate attention after all: back to one compute efficiency
            free = [k for k in free if k != "a"]
            col["c"] = np.where(compute, x["lin"] + x["attn"], 0.0)


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
        if s.kind == "mixed":
            sizes = {"num_tokens": s.tokens, "batch_size": s.batch}
        else:
            sizes = {"num_tokens" if s.kind == "prefill" else "batch_size": s.tokens}
        rows.append({"kind": s.kind, **sizes, "context_len": s.context, "step_time_s": s.step_s})
    return rows
