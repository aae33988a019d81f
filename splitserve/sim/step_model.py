"""A step-time model fitted to measured engine steps (not a roofline): what `sim calibrate
--engine URL --out FILE` saves and `--profile FILE` loads.

- Prefill: t = fixed + per_token * n + per_pair * pairs, where pairs = n * (past + (n + 1) / 2)
  are the (query, key) pairs the chunk's causal attention computes (quadratic in n, linear
  in the cached past). Least squares on relative errors; a negative coefficient is pinned
  at 0 and the rest refitted.
- Decode: t = base(B) + per_context_token * (sum of the batch's contexts). base is a table
  over the measured batch sizes (one intercept each, fitted jointly with the shared context
  slope), made non-decreasing (a larger batch is never faster: what is left is noise),
  interpolated linearly between them and extrapolated along the last segment.
- A re-timed model (`sim retime`, sim/retime.py) also carries a factor per measured batch
  size on the whole decode time, base and context term together, interpolated like base:
  what a serving engine's logged steps of that size cost over the calibrated model's. A
  serving log holds one context length per sequence or so, so it says what a batch costs,
  not how that splits between base and context.
- A mixed step (decodes and prefill chunks): base(B) + context term + each chunk's per-token
  and per-pair work + mixed_fixed: what a chunk adds to a decode step beyond its tokens
  (its attention's own pass, its KV writes). Measured (mixed samples: the median of each
  mixed step's time less the rest of the formula); 0 without mixed samples. The prefill
  fixed cost itself is paid only by a step without decodes.

`ProfiledRoofline` puts the model in the simulator's place of the roofline: the same
`prefill`/`decode` costs, timed by the fitted model instead of by peaks and efficiencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from splitserve.sim.calibrate import CalibrationError, Sample
from splitserve.sim.roofline import Cost, Efficiency, Roofline
from splitserve.sim.specs import GPUSpec, ModelSpec


@dataclass(frozen=True)
class StepModel:
    prefill_fixed_s: float
    prefill_s_per_token: float
    prefill_s_per_pair: float
    decode_batches: tuple[int, ...]  # measured batch sizes, ascending
    decode_base_s: tuple[float, ...]  # per batch size: the step time at zero context
    decode_s_per_context_token: float
    mixed_fixed_s: float = 0.0  # a prefill chunk's fixed cost beside decodes
    decode_scale: tuple[float, ...] = ()  # per batch size: a factor on the whole decode time

    def __post_init__(self) -> None:
        values = (
            self.mixed_fixed_s,
            self.prefill_fixed_s,
            self.prefill_s_per_token,
            self.prefill_s_per_pair,
            self.decode_s_per_context_token,
            *self.decode_base_s,
        )
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise CalibrationError("step model coefficients must be finite and >= 0")
        if not self.decode_batches or len(self.decode_batches) != len(self.decode_base_s):
            raise CalibrationError("the decode table needs one base time per batch size")
        if self.decode_scale and (
            len(self.decode_scale) != len(self.decode_batches)
            or not all(np.isfinite(x) and x > 0 for x in self.decode_scale)
        ):
            raise CalibrationError("the decode scale needs one factor > 0 per batch size, or none")
        if list(self.decode_batches) != sorted(set(self.decode_batches)) or self.decode_batches[0] < 1:
            raise CalibrationError("decode batch sizes must be distinct, ascending and >= 1")
        if self.prefill_s_per_token <= 0 and self.prefill_s_per_pair <= 0:
            raise CalibrationError("prefill time must grow with the prompt")

    def prefill_s(self, tokens: float, past: float = 0.0) -> float:
        pairs = tokens * (past + (tokens + 1) / 2)
        return self.prefill_fixed_s + self.prefill_s_per_token * tokens + self.prefill_s_per_pair * pairs

    def decode_base(self, batch: float | np.ndarray) -> np.ndarray:
        xs, ys = np.array(self.decode_batches, dtype=float), np.array(self.decode_base_s)
        out = np.interp(batch, xs, ys)
        if len(xs) > 1:  # beyond the largest measured batch: along the last segment
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            out = np.where(np.asarray(batch) > xs[-1], ys[-1] + slope * (np.asarray(batch) - xs[-1]), out)
        return out

    def decode_s(self, batch: int, context_total: float | np.ndarray) -> np.ndarray:
        unscaled = self.decode_base(batch) + self.decode_s_per_context_token * np.asarray(context_total)
        if not self.decode_scale:
            return unscaled
        return unscaled * np.interp(batch, np.array(self.decode_batches, dtype=float), self.decode_scale)

    def mixed_s(self, tokens: float, batch: int, context_total: float) -> float:
        """A prompt of `tokens` (no cached past) prefilled beside a decode batch."""
        chunk = self.prefill_s(tokens) - self.prefill_fixed_s
        return float(self.decode_s(batch, context_total)) + self.mixed_fixed_s + chunk

    def to_json(self) -> dict:
        decode: dict = {
            "batch_sizes": list(self.decode_batches),
            "base_s": list(self.decode_base_s),
            "s_per_context_token": self.decode_s_per_context_token,
        }
        if self.decode_scale:
            decode["scale"] = list(self.decode_scale)
        return {
            "prefill": {
                "fixed_s": self.prefill_fixed_s,
                "s_per_token": self.prefill_s_per_token,
                "s_per_pair": self.prefill_s_per_pair,
            },
            "decode": decode,
            "mixed": {"fixed_s": self.mixed_fixed_s},
        }

    @staticmethod
    def from_json(data: object, source: str) -> StepModel:
        try:
            pre, dec = data["prefill"], data["decode"]  # type: ignore[index]
            return StepModel(
                float(pre["fixed_s"]),
                float(pre["s_per_token"]),
                float(pre["s_per_pair"]),
                tuple(int(b) for b in dec["batch_sizes"]),
                tuple(float(t) for t in dec["base_s"]),
                float(dec["s_per_context_token"]),
                float(data.get("mixed", {}).get("fixed_s", 0.0)),  # type: ignore[attr-defined]
                tuple(float(x) for x in dec.get("scale", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(
                f"{source}: sim.steps needs prefill {{fixed_s, s_per_token, s_per_pair}} and decode "
                f"{{batch_sizes, base_s, s_per_context_token, optionally scale}}, and optionally mixed "
                f"{{fixed_s}} ({exc})"
            ) from None

    def predict(self, sample: Sample) -> float:
        if sample.kind == "prefill":
            return self.prefill_s(sample.tokens, sample.context)
        if sample.kind == "mixed":
            return self.mixed_s(sample.tokens, sample.batch, sample.batch * sample.context)
        return float(self.decode_s(sample.tokens, sample.tokens * sample.context))


def _nonneg_lstsq(columns: list[np.ndarray], t: np.ndarray, keep: set[int]) -> np.ndarray:
    """Least squares on relative errors; coefficients outside `keep` that come out negative
    are pinned at 0 and the rest refitted."""
    active = list(range(len(columns)))
    while True:
        a = np.stack([columns[k] / t for k in active], axis=1)
        sol, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        coef = np.zeros(len(columns))
        coef[active] = sol
        bad = [k for k in active if coef[k] < 0 and k not in keep]
        if not bad:
            return np.maximum(coef, 0.0)
        active.remove(bad[0])


def fit_step_model(samples: list[Sample]) -> StepModel:
    prefill = [s for s in samples if s.kind == "prefill"]
    decode = [s for s in samples if s.kind == "decode"]
    if len({(s.tokens, s.context) for s in prefill}) < 2:
        raise CalibrationError("the step model needs prefill steps of at least two prompt shapes")
    if not decode:
        raise CalibrationError("the step model needs decode steps")
    n = np.array([s.tokens for s in prefill], dtype=float)
    past = np.array([s.context for s in prefill], dtype=float)
    t = np.array([s.step_s for s in prefill])
    pairs = n * (past + (n + 1) / 2)
    fixed, per_token, per_pair = _nonneg_lstsq([np.ones_like(n), n, pairs], t, keep=set())
    batches = sorted({s.tokens for s in decode})
    bt = np.array([s.tokens for s in decode])
    ctx = np.array([s.tokens * s.context for s in decode], dtype=float)
    td = np.array([s.step_s for s in decode])
    columns = [(bt == b).astype(float) for b in batches]
    if len({s.context for s in decode}) > 1:
        columns.append(ctx)
    coef = _nonneg_lstsq(columns, td, keep=set(range(len(batches))))
    per_ctx = float(coef[len(batches)]) if len(columns) > len(batches) else 0.0
    base = np.maximum.accumulate(np.maximum(coef[: len(batches)], 0.0))
    model = StepModel(
        float(fixed),
        float(per_token),
        float(per_pair),
        tuple(batches),
        tuple(float(b) for b in base),
        per_ctx,
    )
    mixed = [s for s in samples if s.kind == "mixed"]
    if not mixed:
        return model
    beyond = [s.step_s - model.predict(s) for s in mixed]  # what the formula without it misses
    return replace(model, mixed_fixed_s=max(0.0, float(np.median(beyond))))


def fit_errors(model: StepModel, samples: list[Sample]) -> tuple[float, float]:
    """(rms, max) relative error of the model on the samples."""
    rel = np.array([abs(model.predict(s) - s.step_s) / s.step_s for s in samples])
    return float(np.sqrt(np.mean(rel**2))), float(rel.max())


class ProfiledRoofline(Roofline):
    """The roofline's step costs, timed by a fitted `StepModel` (one instance, `tp` devices:
    the model was measured on the deployment it describes, so `tp` only scales the memory)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, steps: StepModel, tp: int = 1) -> None:
        super().__init__(model, gpu, Efficiency(), tp=tp)
        self.steps = steps
        self._per_pair = float(model.attn_flops_per_pair) or 1.0

    def step_s(self, cost: Cost) -> float:
        if cost.tokens == 0:
            return 0.0
        batch = cost.tokens - cost.prefill_tokens
        chunks = cost.seqs - batch
        pairs = cost.prefill_attn_flops / self._per_pair
        s = self.steps
        prefill = s.prefill_s_per_token * cost.prefill_tokens + s.prefill_s_per_pair * pairs
        if batch == 0:
            return float(s.prefill_fixed_s + prefill) if chunks else 0.0
        mixed = s.mixed_fixed_s if chunks else 0.0
        return float(s.decode_s(batch, cost.decode_attn_flops / self._per_pair)) + prefill + mixed

    def decode_times(self, batch: int, context_totals: np.ndarray) -> np.ndarray:
        return np.asarray(self.steps.decode_s(batch, context_totals), dtype=float)
