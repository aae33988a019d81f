"""The planner for one host's CPU cores: which `splitserve up` layout serves a rate within
the SLOs here. `up --plan` (deploy/up_plan.py) runs it and starts the layout it picks.

A layout is a number of engines and the CPUs each gets: collocated (`--prefill 0 --decode
N`, the first a `serve`-like stack), or P prefill and D decode engines. The host's cores
are split evenly, each engine pinned to its own (none pinned when one engine has them
all); the render tier and the proxy run on every core, as without `--cpu-affinity`.

An engine of k cores is simulated as follows. With a measured profile (`sim calibrate`):
the step times measured on an engine of k threads where the profile has them (`sim
calibrate --engine URL --engine URL1`, one engine per thread count); else those taken on an
engine of `measured_cores` (the profile's recorded threads, or every CPU here), the work
that grows with the tokens (per prompt token, per attention pair, per cached context
token) divided by k / measured_cores, the fixed costs (a step's own, a decode batch's base)
not. That scaling is rough: measured on the bench model, a one-thread engine's batch-1
decode step took 3.0 ms against 2.0 on two threads (a step of few tokens runs on every
thread unless `--serial-step-tokens` says otherwise), which the scaling keeps at 2.0.
Without one, the roofline of the model's config.json at the realistic preset (what `sim
plan` uses without `--profile`) on k cores of CPU_CORE's figures.

The pick: of the layouts whose steady-state attainment at the rate meets the target with
`MARGIN` to spare (predicted goodput >= rate x (1 + MARGIN)), those with the fewest engines
(each holds its own weights and KV pool), and of those the most headroom (predicted goodput
/ rate - 1); when none has the margin, the one meeting it with the most headroom. The
margin is the model's own error near capacity on a shared host (docs/sim.md): at 12 req/s
on 2 cores the fewest-engines rule once picked a layout predicted to meet it with +0%
headroom, which measured 65%, over two with +30% that measured 100%. Where the
predictions tie, the layout with fewer prefill engines wins: a split must be predicted to
pay for itself (at 16 req/s on 2 cores the model ties 1P+1D with two collocated engines,
which measured 0-22% more goodput in six runs). When none meets the target, the ranking
is by attainment at the rate and nothing is picked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from splitserve.config import SchedulerConfig, TransferConfig
from splitserve.goodput import SLO
from splitserve.protocol.pd_decision import CostModel
from splitserve.sim.cmd_common import REALISTIC_EFFICIENCY
from splitserve.sim.deployment import Deployment, KVLink
from splitserve.sim.engine import InstanceConfig
from splitserve.sim.metrics import WorkloadFactory
from splitserve.sim.profile import DECISION_PROMPT_TOKENS, EngineProfile
from splitserve.sim.specs import GPUSpec, ModelSpec
from splitserve.sim.steady import SteadyState, estimate, search_goodput
from splitserve.sim.step_model import StepModel

# One core's figures when no profile is given (datasheet-style, as the built-in GPUs): fp32
# FMA on two 256-bit units at ~3 GHz (~100 GFLOP/s) and ~10 GB/s of memory bandwidth.
CPU_CORE = GPUSpec("cpu-core", peak_flops=1e11, mem_bw=1e10, mem_bytes=8e9, link_bw=1e10, net_bw=1e10)
DEFAULT_MAX_ENGINES = 4
MARGIN = 0.10  # headroom the pick wants beyond the rate before fewer engines win (module doc)


class HostLayout(NamedTuple):
    prefill: int  # prefill engines (0: collocated, every engine prefills its own prompts)
    decode: int
    cpus: tuple[tuple[int, ...], ...]  # each engine's CPUs: the prefill engines', then decode's

    @property
    def engines(self) -> int:
        return self.prefill + self.decode

    @property
    def cores_per_engine(self) -> int:
        return len(self.cpus[0])

    def label(self) -> str:
        if self.prefill == 0:
            kind = "serve-like" if self.decode == 1 else "collocated"
            return f"{self.decode} decode ({kind})"
        return f"{self.prefill} prefill + {self.decode} decode"

    def part_names(self) -> list[str]:
        """The engines' names as `up` gives them (deploy/plan.py: `ROLE-INDEX`)."""
        return [f"prefill-{i}" for i in range(self.prefill)] + [f"decode-{i}" for i in range(self.decode)]

    def cpu_affinity(self, available: Sequence[int]) -> list[str]:
        """`up --cpu-affinity` entries pinning each engine to its CPUs (none when a single
        engine has every available core: that is no pinning at all)."""
        if self.engines == 1 and set(self.cpus[0]) == set(available):
            return []
        names = self.part_names()
        return [f"{name}={','.join(map(str, cpus))}" for name, cpus in zip(names, self.cpus, strict=True)]


class RankedLayout(NamedTuple):
    layout: HostLayout
    attainment: float  # steady-state fraction meeting every SLO at the rate
    half_width: float  # of its 95% confidence interval
    goodput: float  # highest rate found to meet the target (req/s)
    meets: bool  # attainment at the rate >= target
    remote_fraction: float | None  # P/D: share of requests through a prefill engine at the rate
    note: str  # why it was not simulated ("prefill-bound": prefills alone exceed the engines), or ""


def host_layouts(cpus: Sequence[int], max_engines: int = DEFAULT_MAX_ENGINES) -> list[HostLayout]:
    """Every layout of up to `max_engines` engines (at most one per core) on `cpus`, each
    engine on len(cpus) // engines of them."""
    ordered = sorted(set(cpus))
    if not ordered:
        raise ValueError("no CPUs to plan for")
    if max_engines < 1:
        raise ValueError("the largest engine count must be >= 1")
    out: list[HostLayout] = []
    for engines in range(1, min(max_engines, len(ordered)) + 1):
        per = len(ordered) // engines
        shares = tuple(tuple(ordered[i * per : (i + 1) * per]) for i in range(engines))
        for prefill in range(engines):  # 0: collocated; at least one decode engine
            out.append(HostLayout(prefill, engines - prefill, shares))
    return out


def steps_on_cores(steps: StepModel, measured_cores: int, cores: int) -> StepModel:
    """The profile's step times on an engine of `cores` CPUs instead of `measured_cores`:
    the token-proportional work scales inversely with the cores, the fixed costs stay."""
    scale = measured_cores / cores
    return replace(
        steps,
        prefill_s_per_token=steps.prefill_s_per_token * scale,
        prefill_s_per_pair=steps.prefill_s_per_pair * scale,
        decode_s_per_context_token=steps.decode_s_per_context_token * scale,
    )


def cores_spec(cores: int) -> GPUSpec:
    """`cores` CPU cores as the simulator's device."""
    c = CPU_CORE
    return replace(c, name=f"{cores} CPU cores", peak_flops=c.peak_flops * cores, mem_bw=c.mem_bw * cores)


def host_deployment(
    model: ModelSpec, profile: EngineProfile | None, scheduler: SchedulerConfig, kv_mode: str = "push"
) -> Deployment:
    """The simulator's deployment of `up`'s engines before a layout is chosen: the engines'
    scheduler (token budget, long-prefill threshold), several prompts per step, least-loaded
    routing and a P/D handoff over
    shared memory (the profile's measured one, else at the host's copy bandwidth); the
    P/D path decided on cost, as the proxy's default `--pd-decision cost`. KV capacity is
    not enforced (each engine's pool is its own `--kv-cache-memory`, not the host's)."""
    sched = InstanceConfig(scheduler)
    link = KVLink(gbps=CPU_CORE.mem_bw * 8 / 1e9)
    if profile is not None and profile.handoff_fixed_s is not None:
        per_byte = profile.handoff_s_per_byte or 0.0
        gbps = 8 / (per_byte * 1e9) if per_byte > 0 else link.gbps
        link = KVLink(gbps=gbps, overhead_s=profile.handoff_fixed_s)
    return Deployment(
        model,
        CPU_CORE,
        eff=REALISTIC_EFFICIENCY,
        combine="sum",
        sched=sched,
        prefill_sched=sched,
        routing="least_loaded",
        transfer=TransferConfig(mode="pull" if kv_mode == "pull" else "push"),
        link=link,
        steps=profile.steps if profile else None,
        cpu=profile.cpu if profile else None,
        waits=profile.waits if profile else None,
        path=profile.path if profile else None,
        pd_costs=profile.decision_costs() if profile else CostModel(),
    )


def layout_deployment(
    base: Deployment,
    layout: HostLayout,
    measured_cores: int,
    measured_steps: Mapping[int, StepModel] | None = None,
) -> Deployment:
    """`base` run as `layout`: its engine counts, each engine on its share of the cores
    (with the steps measured on that many threads, if `measured_steps` has them)."""
    cores = layout.cores_per_engine
    # the tiers' CPU runs on an idle engine's cores, or beside busy ones (simulator.py); a
    # k-thread engine loses k seconds per second of it on its cores: its other threads wait
    # at the step's next barrier (measured: a 2-thread serve-like engine's steps ran 13 s
    # beyond the profile's during 6.4 s of the tiers' and the client's CPU)
    dep = replace(base, gpu=cores_spec(cores), own_loss=cores)
    if measured_steps and cores in measured_steps:
        dep = replace(dep, steps=measured_steps[cores])
    elif base.steps is not None:
        dep = replace(dep, steps=steps_on_cores(base.steps, measured_cores, cores))
    if layout.prefill == 0:
        return replace(dep, mode="collocated", replicas=layout.decode)
    dep = replace(dep, mode="pd", prefill_instances=layout.prefill, decode_instances=layout.decode)
    if dep.pd_costs is not None and dep.steps is not None:
        # `up`'s proxy decides on what it measures: a prefill worker's step time over its
        # tokens (router/pd_costs.py), on this layout's engines, not the profile's
        roofline = dep.roofline(1)
        per_token = roofline.step_s(roofline.prefill(DECISION_PROMPT_TOKENS)) / DECISION_PROMPT_TOKENS
        costs = replace(dep.pd_costs, prefill_s_per_token=per_token, decode_prefill_s_per_token=per_token)
        dep = replace(dep, pd_costs=costs)
    return dep


def prefill_capacity(dep: Deployment, layout: HostLayout, prompt_tokens: float) -> float:
    """Requests/s the engines could prefill doing nothing else, every engine prefilling
    (under the cost decision a P/D decode engine prefills the prompts it keeps): an upper
    bound on any layout's goodput."""
    roofline = dep.roofline(1)
    return layout.engines / roofline.step_s(roofline.prefill(int(prompt_tokens)))


def rank_layouts(
    layouts: Sequence[HostLayout],
    base: Deployment,
    make: WorkloadFactory,
    slos: Sequence[SLO],
    rate: float,
    prompt_tokens: float,
    measured_cores: int,
    target: float = 0.9,
    cfg: SteadyState = SteadyState(),
    iters: int = 5,
    tick: Callable[[], None] | None = None,
    measured_steps: Mapping[int, StepModel] | None = None,
) -> list[RankedLayout]:
    """Each layout's predicted attainment at `rate` and goodput, best first: the pick
    (if any meets the target) is the first."""
    ranked: list[RankedLayout] = []
    for layout in layouts:
        dep = layout_deployment(base, layout, measured_cores, measured_steps)
        capacity = prefill_capacity(dep, layout, prompt_tokens)
        if capacity < rate:
            ranked.append(RankedLayout(layout, 0.0, 0.0, 0.0, False, None, "prefill-bound"))
            continue
        at_rate = estimate(dep, make, rate, slos, cfg, target, tick)
        meets = at_rate.attainment >= target
        if meets:
            found = search_goodput(dep, make, slos, rate, 1.2 * capacity, target, cfg, iters, tick, at_rate)
        else:
            found = search_goodput(dep, make, slos, rate / 16, rate, target, cfg, iters, tick)
        summary = at_rate.result.summary()
        remote = float(summary["remote_fraction"]) if "remote_fraction" in summary else None
        ranked.append(
            RankedLayout(layout, at_rate.attainment, at_rate.half_width, found.goodput, meets, remote, "")
        )
    return sorted(ranked, key=lambda r: rank_key(r, rate))


def rank_key(r: RankedLayout, rate: float) -> tuple:
    """Meeting the target with MARGIN first, among those the fewest engines, then the most
    goodput, then the highest attainment at the rate; then those meeting it without the
    margin by goodput; last the rest by attainment. Where the predictions tie, the layout
    with fewer prefill engines: a split must be predicted to pay for itself."""
    split = r.layout.prefill
    if r.meets and r.goodput >= rate * (1 + MARGIN):
        return (0, r.layout.engines, -r.goodput, -r.attainment, split, r.layout.label())
    if r.meets:
        return (1, -r.goodput, -r.attainment, r.layout.engines, split, r.layout.label())
    return (2, -r.attainment, -r.goodput, split, r.layout.label())
