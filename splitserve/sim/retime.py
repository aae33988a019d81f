"""`sim retime`: a profile's step times re-timed from a live engine's own steps (its
`--step-log`), for the engines that are running now.

`sim calibrate --engine URL` times each step shape a few times on a probe engine, in a
minute or two. On a shared host the same engine's speed moves by tens of percent from one
process to the next and over minutes (docs/sim.md: one one-thread engine's one-token step
4.3 ms in a calibration and 7.3-7.5 ms in the run that followed it, at every load). The
step log of an engine that is serving says what its steps cost now: each record carries
the step's shape (`StepShape`) and the engine thread's CPU time, so each logged step can
be set against what the profile's model says for the same shape.

What is re-timed, per thread count the profile has a model for (steps run on an idle
lender's CPUs too are left out: their threads are not the engine's own):

- Decode: the whole decode time (base and context term) at each batch size of the
  model's table by the median ratio of the logged decode-only steps from it up to the next
  one (where at least `MIN_STEPS` were logged; else by the median over every decode-only
  step), kept non-decreasing at zero context. Not the base alone: a serving log's
  sequences have about one context length, so its steps say what a batch costs, not how
  the cost splits between base and context; scaling only the base by a ratio of the
  whole left `serve`'s steps of 8-16 sequences 15-30% over their logged CPU (docs/sim.md).
- Prompts: the prefill terms (fixed, per token, per attended pair) and a chunk's fixed
  cost beside decodes by one median ratio over the steps that computed prompt chunks: the
  step's CPU less its decodes' (re-timed) part, over the chunks' modelled part.

A step's cost is the engine thread's CPU since the same process's previous record. Its
wait for a core, the rest of its wall time, is fitted apart (sim/step_waits.py) and kept
in the profile beside the step models, for the layout whose engines logged it. The
model's shape (how a step's cost splits between base and context, and between per-token
and per-pair work) stays the calibration's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from splitserve.protocol.step_record import PricedStep, StepRecord, priced_steps
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.profile import EngineProfile
from splitserve.sim.step_model import StepModel
from splitserve.sim.step_waits import fit_step_waits

MIN_STEPS = 10  # logged decode steps a batch size of the table needs for a factor of its own


class RetimeFactors(NamedTuple):
    threads: int
    batches: tuple[int, ...]  # the decode table's batch sizes
    decode: tuple[float, ...]  # per batch size: logged / modelled
    prompt: float  # a prompt chunk's work: logged / modelled
    decode_steps: int  # the logged steps each was measured on
    prompt_steps: int


def decode_part_s(model: StepModel, r: StepRecord) -> float:
    return float(model.decode_s(r.decodes, r.context or 0)) if r.decodes else 0.0


def prompt_part_s(model: StepModel, r: StepRecord) -> float:
    """The modelled time of a step's prompt chunks (ProfiledRoofline.step_s's terms): each
    chunk's work, and one fixed cost, a prompt step's own or a chunk's beside decodes."""
    work = sum(model.prefill_s(n, past) - model.prefill_fixed_s for n, past in r.chunks)
    return work + (model.mixed_fixed_s if r.decodes else model.prefill_fixed_s)


def retime_steps(
    model: StepModel, steps: Sequence[PricedStep], threads: int
) -> tuple[StepModel, RetimeFactors]:
    """`model` re-timed by `steps`, logged on an engine of `threads` (module doc)."""
    decoding = [s for s in steps if s.record.decodes and not s.record.chunks]
    ratios = np.array([s.cpu_s / decode_part_s(model, s.record) for s in decoding])
    overall = float(np.median(ratios)) if len(ratios) else 1.0
    batches = np.array([s.record.decodes for s in decoding])
    factors = []
    for i, b in enumerate(model.decode_batches):
        upper = model.decode_batches[i + 1] if i + 1 < len(model.decode_batches) else np.inf
        mine = ratios[(batches >= b) & (batches < upper)]
        factors.append(float(np.median(mine)) if len(mine) >= MIN_STEPS else overall)
    base = np.array(model.decode_base_s)
    scale = np.array(model.decode_scale or [1.0] * len(base)) * np.array(factors)
    for i in range(1, len(scale)):  # a larger batch is never faster
        if base[i] > 0:
            scale[i] = max(scale[i], scale[i - 1] * base[i - 1] / base[i])
    decode = replace(model, decode_scale=tuple(float(x) for x in scale))
    prompting = [s for s in steps if s.record.chunks]
    prompt_ratios = [
        (s.cpu_s - decode_part_s(decode, s.record)) / prompt_part_s(model, s.record) for s in prompting
    ]
    prompt = max(0.0, float(np.median(prompt_ratios))) if prompt_ratios else 1.0
    retimed = replace(
        decode,
        prefill_fixed_s=model.prefill_fixed_s * prompt,
        prefill_s_per_token=model.prefill_s_per_token * prompt,
        prefill_s_per_pair=model.prefill_s_per_pair * prompt,
        mixed_fixed_s=model.mixed_fixed_s * prompt,
    )
    counts = (len(decoding), len(prompting))
    return retimed, RetimeFactors(threads, model.decode_batches, tuple(factors), prompt, *counts)


def retime_profile(
    profile: EngineProfile, records: Sequence[StepRecord], waits: bool = False
) -> tuple[EngineProfile, list[RetimeFactors]]:
    """`profile` with the step models of every thread count the log has steps of re-timed,
    and with `waits`, the steps' waits for a core fitted (for the layout that logged them:
    step_waits.py). CalibrationError when the log has no step the profile has a model for."""
    steps = priced_steps(records)
    if not steps:
        raise CalibrationError(
            "the step log has no step with its shape (an engine's --step-log from before shapes were logged?)"
        )
    measured = profile.measured_steps()
    if not measured:
        raise CalibrationError("the profile does not say which thread count its steps were measured on")
    found = sorted({s.record.threads for s in steps})
    usable = [t for t in found if t in measured]
    if not usable:
        raise CalibrationError(
            f"the step log's engines ran on {found} thread(s); the profile has steps of {sorted(measured)}"
        )
    retimed: dict[int, StepModel] = {}
    factors = []
    for threads in usable:
        model, f = retime_steps(measured[threads], [s for s in steps if s.record.threads == threads], threads)
        retimed[threads] = model
        factors.append(f)
    primary = retimed.get(profile.threads, profile.steps) if profile.threads else profile.steps
    others = {k: retimed.get(k, v) for k, v in profile.other_steps.items()}

    def compute_s(r: StepRecord) -> float | None:
        model = retimed.get(r.threads) if r.threads is not None else None
        if model is None or r.decodes is None:
            return None
        return decode_part_s(model, r) + (prompt_part_s(model, r) if r.chunks else 0.0)

    fitted = fit_step_waits(records, compute_s) if waits else profile.waits
    return replace(profile, steps=primary, other_steps=others, waits=fitted), factors


def factor_rows(factors: Sequence[RetimeFactors]) -> list[str]:
    """One line per thread count: the factors each part of its model was re-timed by."""
    rows = []
    for f in factors:
        table = ", ".join(f"B={b}: x{x:.2f}" for b, x in zip(f.batches, f.decode, strict=True))
        rows.append(
            f"{f.threads} thread(s): decode {table} ({f.decode_steps} steps); "
            f"prompts x{f.prompt:.2f} ({f.prompt_steps} steps)"
        )
    return rows
