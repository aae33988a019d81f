"""The engine profile file: one JSON object that both the simulator/planner (`--profile
FILE`) and the proxy (`splitserve proxy --pd-cost-profile FILE`) read.

    {"model": NAME, "gpu": NAME,
     "samples": [...measured steps, calibrate.py's format...],
     "prefill_s_per_token": ..., "decode_prefill_s_per_token": ...,   # P/D decision costs
     "handoff_fixed_s": ..., "handoff_s_per_token": ...,               # (protocol/pd_decision.py)
     "sim": {"version": 1,
             "steps": {...step_model.py's fitted prefill and decode step times...},
             "threads": N,   # the threads of the engine those steps were measured on
             "steps_by_threads": {"1": {...}, ...},   # other engines' (calibrate --engine x2)
             "cpu": {"render_s_per_request": ..., "render_s_per_token": ...,
                     "proxy_s_per_request": ..., "cpu_s_per_request": ...,
                     "cpu_s_per_remote_request": ..., "cpu_s_per_step": ...,
                     "cpu_s_per_token": ..., "engine_s_per_request": ..., ...},
             "handoff": {"fixed_s": ..., "s_per_byte": ...},
             "fit": {"rms_rel_error": ..., "max_rel_error": ..., "samples": N}}}

The top-level cost fields are the proxy's `CostModel` fields: the proxy pins what the file
names; the simulator's P/D decision (protocol/pd_decision.py, the proxy's own) uses the
same numbers. "sim" is the simulator's alone (the proxy ignores it). A file with samples but
no "sim" (what `sim calibrate --save` wrote) is a profile too: its step model is fitted on loading.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from splitserve.protocol.pd_decision import COST_FIELDS, CostModel
from splitserve.sim.calibrate import CalibrationError, Sample, parse_samples, samples_to_json
from splitserve.sim.path_latency import PathLatency
from splitserve.sim.step_model import StepModel, fit_errors, fit_step_model
from splitserve.sim.step_waits import StepWaits

PROFILE_VERSION = 1
T = TypeVar("T")
# the prompt at which a prefill step's cost per token stands for the P/D decision's
DECISION_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class CpuCosts:
    """The tiers around the engine. Delays: what the render tier spends on a request before
    the engine sees it, and what the proxy adds on the way in. CPU: what the proxy and the
    render tier take from the engines' cores (sim/engine.py), per request (charged to the
    engine its prompt goes to), per request sent through a prefill worker, per step that
    streams tokens and per streamed token (both charged to the streaming engine). And each
    engine's own process beyond its engine thread (its API, the KV it pushes or takes in),
    which runs on that engine's cores alone: per request it takes in, per request it
    prefills for a decode worker, and per step and token it streams."""

    render_s_per_request: float = 0.0
    render_s_per_token: float = 0.0  # per prompt token
    proxy_s_per_request: float = 0.0  # beyond the render tier's, on the way in
    # an engine's own HTTP API beyond its steps (the request's way in, the answer's way out):
    # all of `serve`'s way, which has no proxy (in `up` the proxy's figure holds it)
    api_s_per_request: float = 0.0
    cpu_s_per_request: float = 0.0
    cpu_s_per_remote_request: float = 0.0  # beyond cpu_s_per_request
    cpu_s_per_step: float = 0.0
    cpu_s_per_token: float = 0.0
    engine_s_per_request: float = 0.0  # the engine that decodes it (or prefills it locally)
    engine_s_per_remote_request: float = 0.0  # a decode worker's, beyond engine_s_per_request
    prefill_engine_s_per_request: float = 0.0  # a prefill worker's (its API and KV push)
    engine_s_per_step: float = 0.0
    engine_s_per_token: float = 0.0

    def delay_s(self, prompt_tokens: int) -> float:
        return self.render_s_per_request + self.render_s_per_token * prompt_tokens + self.proxy_s_per_request

    def stream_cpu(self, loss: float) -> StreamCpu:
        """What a streaming engine's steps cost it, when it loses `loss` seconds per second
        of other CPU on its cores: its own process's, and its share of the tiers'."""
        return StreamCpu(
            loss * self.engine_s_per_step,
            loss * self.engine_s_per_token,
            self.cpu_s_per_step,
            self.cpu_s_per_token,
            loss,
        )


class StreamCpu(NamedTuple):
    """A streaming step's CPU beyond its compute: `own_*` lengthens the engine's own step
    (its own API, on its cores); `shared_*` is the tiers' CPU, which runs on an idle
    engine's cores where there is one and otherwise beside the busy engines by their idle
    shares (simulator.py), this one losing `tiers_loss` seconds per second of its share."""

    own_s_per_step: float = 0.0
    own_s_per_token: float = 0.0
    shared_s_per_step: float = 0.0
    shared_s_per_token: float = 0.0
    tiers_loss: float = 0.0

    def stall_s(self, streamed: int, tiers_share: float = 1.0) -> float:
        """How much longer a step streaming `streamed` tokens takes, when `tiers_share` of
        the tiers' CPU for them runs on this engine's cores."""
        if not streamed:
            return 0.0
        own = self.own_s_per_step + self.own_s_per_token * streamed
        return own + self.tiers_loss * tiers_share * self.shared_s(streamed)

    def shared_s(self, streamed: int) -> float:
        return self.shared_s_per_step + self.shared_s_per_token * streamed if streamed else 0.0


CPU_FIELDS = tuple(f.name for f in dataclasses.fields(CpuCosts))


@dataclass(frozen=True)
class EngineProfile:
    steps: StepModel
    samples: tuple[Sample, ...] = ()
    pd_costs: dict[str, float] = field(default_factory=dict)  # the named P/D cost fields
    cpu: CpuCosts | None = None
    handoff_fixed_s: float | None = None
    handoff_s_per_byte: float | None = None
    model: str | None = None
    gpu: str | None = None
    threads: int | None = None  # of the engine `steps` was measured on (None: not recorded)
    other_steps: dict[int, StepModel] = field(default_factory=dict)  # engines of other thread counts
    # what steps wait for a core beyond their compute, fitted from a layout's step logs
    # (`sim retime`): the simulator puts it beside each step instead of placing `cpu` itself
    waits: StepWaits | None = None
    # the path around the engines (render, proxy, client) and each later token's relay back
    # as they grow with the load, fitted from a bench run of the layout (`sim retime
    # --bench`): instead of `cpu`'s fixed delays
    path: PathLatency | None = None

    def measured_steps(self) -> dict[int, StepModel]:
        """Every step model measured, by the engine's thread count."""
        return {**self.other_steps, **({self.threads: self.steps} if self.threads else {})}

    def decision_costs(self) -> CostModel:
        """The P/D decision's costs: the named fields, the rest from the step model."""
        per_token = self.steps.prefill_s_per_token + self.steps.prefill_s_per_pair * DECISION_PROMPT_TOKENS
        values: dict[str, float] = {"prefill_s_per_token": per_token, "decode_prefill_s_per_token": per_token}
        if self.handoff_fixed_s is not None:
            values["handoff_fixed_s"] = self.handoff_fixed_s
        values.update(self.pd_costs)
        return CostModel(**values)

    def to_json(self) -> dict:
        sim: dict = {"version": PROFILE_VERSION, "steps": self.steps.to_json()}
        if self.threads:
            sim["threads"] = self.threads
        if self.other_steps:
            sim["steps_by_threads"] = {str(k): v.to_json() for k, v in sorted(self.other_steps.items())}
        if self.samples:
            rms, worst = fit_errors(self.steps, list(self.samples))
            sim["fit"] = {"rms_rel_error": rms, "max_rel_error": worst, "samples": len(self.samples)}
        if self.cpu is not None:
            sim["cpu"] = dataclasses.asdict(self.cpu)
        if self.handoff_fixed_s is not None:
            sim["handoff"] = {"fixed_s": self.handoff_fixed_s, "s_per_byte": self.handoff_s_per_byte or 0.0}
        if self.waits is not None:
            sim["waits"] = self.waits.to_json()
        if self.path is not None:
            sim["path"] = self.path._asdict()
        doc: dict = {"model": self.model, "gpu": self.gpu}
        doc.update(self.pd_costs)
        doc["samples"] = samples_to_json(list(self.samples))
        doc["sim"] = sim
        return doc


def slope_s_per_token(samples: list[Sample]) -> float:
    """Least-squares slope of prefill step time over prompt tokens, on an empty cache (the
    figure the proxy derives from samples: protocol/pd_decision.py)."""
    points = [(s.tokens, s.step_s) for s in samples if s.kind == "prefill" and s.context == 0]
    if len({n for n, _ in points}) < 2:
        raise CalibrationError("need prefill steps of at least two prompt lengths")
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    num = sum((n - mean_n) * (t - mean_t) for n, t in points)
    slope = num / sum((n - mean_n) ** 2 for n, _ in points)
    if not slope > 0:
        raise CalibrationError("the measured prefill time does not grow with the prompt")
    return slope


def build_profile(
    samples: list[Sample],
    model: str | None,
    gpu: str | None,
    cpu: CpuCosts | None = None,
    handoff: tuple[float, float] | None = None,
    kv_bytes_per_token: int = 0,
) -> EngineProfile:
    """The profile of measured steps (and tier costs): the fitted step model, and the P/D
    decision's costs the proxy will pin. `handoff` is what the remote path spends beyond
    the local one (tier_probe.measure_handoff): the decision weighs all of it; the
    simulator's link takes it less the engines' own CPU for a remote request (the prefill
    worker's API and KV push, the decode worker's intake), which it already puts in those
    engines' steps."""
    per_token = slope_s_per_token(samples)
    pd_costs = {"prefill_s_per_token": per_token, "decode_prefill_s_per_token": per_token}
    link_fixed_s = None
    if handoff is not None:
        pd_costs["handoff_fixed_s"] = handoff[0]
        pd_costs["handoff_s_per_token"] = handoff[1] * kv_bytes_per_token
        in_steps = cpu.prefill_engine_s_per_request + cpu.engine_s_per_remote_request if cpu else 0.0
        link_fixed_s = max(0.0, handoff[0] - in_steps)
    return EngineProfile(
        fit_step_model(samples),
        tuple(samples),
        pd_costs,
        cpu,
        link_fixed_s,
        handoff[1] if handoff else None,
        model,
        gpu,
    )


def _number(data: dict, key: str, source: str) -> float:
    value = data.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise CalibrationError(f"{source}: {key} must be a number >= 0")
    return float(value)


def parse_profile(data: object, source: str = "profile") -> EngineProfile:
    if not isinstance(data, dict):
        raise CalibrationError(f"{source}: expected a JSON object (a `sim calibrate --out` profile)")
    sim = data.get("sim", {})
    if not isinstance(sim, dict):
        raise CalibrationError(f"{source}: 'sim' must be an object")
    samples: list[Sample] = []
    if data.get("samples"):
        try:
            samples, _ = parse_samples(data["samples"])
        except CalibrationError as exc:
            raise CalibrationError(f"{source}: {exc}") from None
    if "steps" in sim:
        steps = StepModel.from_json(sim["steps"], source)
    elif samples:
        steps = fit_step_model(samples)
    else:
        raise CalibrationError(f"{source}: no step model (sim.steps) and no samples to fit one")
    pd_costs = {}
    for name in COST_FIELDS:
        if name in data:
            pd_costs[name] = _number(data, name, source)
    cpu = None
    if "cpu" in sim:
        c = sim["cpu"] if isinstance(sim["cpu"], dict) else {}
        unknown = sorted(set(c) - set(CPU_FIELDS))
        if unknown:
            raise CalibrationError(
                f"{source}: sim.cpu: unknown field {unknown[0]!r} ({', '.join(CPU_FIELDS)})"
            )
        cpu = CpuCosts(**{name: _number(c, name, f"{source} sim.cpu") for name in CPU_FIELDS})
    handoff = sim.get("handoff") if isinstance(sim.get("handoff"), dict) else None
    threads = sim.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise CalibrationError(f"{source}: sim.threads must be an integer >= 1")
    by_threads = sim.get("steps_by_threads", {})
    if not isinstance(by_threads, dict) or not all(k.isdigit() and int(k) >= 1 for k in by_threads):
        raise CalibrationError(f'{source}: sim.steps_by_threads maps thread counts ("1", ...) to step models')
    other_steps = {
        int(k): StepModel.from_json(v, f"{source} sim.steps_by_threads.{k}") for k, v in by_threads.items()
    }
    waits = fitted_part(sim, "waits", StepWaits.from_json, source)
    path = fitted_part(sim, "path", PathLatency.from_json, source)
    profile = EngineProfile(
        steps,
        tuple(samples),
        pd_costs,
        cpu,
        _number(handoff, "fixed_s", source + " sim.handoff") if handoff else None,
        _number(handoff, "s_per_byte", source + " sim.handoff") if handoff else None,
        data.get("model") if isinstance(data.get("model"), str) else None,
        data.get("gpu") if isinstance(data.get("gpu"), str) else None,
        threads,
        other_steps,
        waits,
        path,
    )
    try:
        profile.decision_costs()
    except ValueError as exc:
        raise CalibrationError(f"{source}: {exc}") from None
    return profile


def fitted_part(sim: dict, key: str, parse: Callable[[object, str], T], source: str) -> T | None:
    """`sim[key]` parsed (a part `sim retime` fits), None where absent; CalibrationError
    naming what is wrong."""
    if key not in sim:
        return None
    try:
        return parse(sim[key], f"{source} sim.{key}")
    except ValueError as exc:
        raise CalibrationError(str(exc)) from None


def load_profile(path: str) -> EngineProfile:
    source = f"--profile {path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CalibrationError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{source}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{source}: not JSON ({exc})") from None
    return parse_profile(data, source)


def save_profile(profile: EngineProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")
