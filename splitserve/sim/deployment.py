"""What the simulator runs: the engines (collocated replicas, or P/D prefill and decode
pools), their scheduling, the KV link between them, and what a measured profile adds (step
times, the tiers' costs, the steps' fitted waits, the path's latency)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.config import TransferConfig
from splitserve.protocol.pd_decision import CostModel
from splitserve.sim.engine import InstanceConfig
from splitserve.sim.path_latency import PathLatency
from splitserve.sim.profile import CpuCosts
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.specs import GPUSpec, ModelSpec
from splitserve.sim.step_model import ProfiledRoofline, StepModel
from splitserve.sim.step_waits import StepWaits


@dataclass(frozen=True)
class KVLink:
    """The path KV takes from prefill to decode: a measured handoff `fixed_s` (such as the
    guide's 1.3 s, notification included), or bytes over `gbps` plus `overhead_s`."""

    fixed_s: float | None = None
    gbps: float = 200.0
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fixed_s is not None and self.fixed_s < 0:
            raise ValueError("fixed transfer time must be >= 0")
        if self.gbps <= 0 or self.overhead_s < 0:
            raise ValueError("link bandwidth must be > 0 and overhead >= 0")


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    gpu: GPUSpec
    mode: str = "collocated"  # or "pd"
    replicas: int = 2  # collocated instances behind the router
    prefill_instances: int = 1
    decode_instances: int = 1
    tp: int = 1  # GPUs per collocated instance
    tp_prefill: int = 1
    tp_decode: int = 1
    eff: Efficiency = field(default_factory=Efficiency)
    combine: str = "max"
    sched: InstanceConfig = field(default_factory=lambda: InstanceConfig(prompts_per_step=1))
    prefill_sched: InstanceConfig = field(
        default_factory=lambda: InstanceConfig(chunked_prefill=False, prompts_per_step=1)
    )
    routing: str = "round_robin"  # or "random", "least_loaded" (splitserve's router)
    # splitserve's transfer mode: push streams KV layer by layer during prefill and decode
    # picks it up at its next step boundary; pull sends it after prefill, once decode next
    # checks between its steps (vLLM NIXL)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    link: KVLink = field(default_factory=KVLink)
    bidirectional: bool = False  # multi-turn: prefill pulls the last answer's KV back from decode
    kv_limit: bool = False  # reserve KV memory per request; capacity from GPU memory
    mem_util: float = 0.9
    prefix_ttl_s: float = 480.0
    # a measured engine (`--profile`): fitted step times instead of the roofline's
    steps: StepModel | None = None
    # P/D: decide each request's path on cost (conditional disaggregation); None: every
    # request through a prefill worker
    pd_costs: CostModel | None = None
    cpu: CpuCosts | None = None  # the tiers around the engines: delays and CPU (profile.py)
    # the steps' waits for a core, fitted from a layout's step logs (sim/step_waits.py): put
    # beside each step instead of placing `cpu`'s CPU on the engines' cores
    waits: StepWaits | None = None
    # the path around the engines, growing with the requests in flight (sim/path_latency.py):
    # each request's delay before an engine sees it, instead of `cpu`'s fixed one, and each
    # later token's relay back to its client
    path: PathLatency | None = None
    # seconds an engine of k threads loses per second of CPU other processes run on its k
    # cores (its own process's beyond its engine thread, the tiers' placed there): k, as
    # its other threads wait at the step's next barrier (host_planner.layout_deployment)
    own_loss: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("collocated", "pd"):
            raise ValueError("mode must be 'collocated' or 'pd'")
        if self.routing not in ("round_robin", "random", "least_loaded"):
            raise ValueError("routing must be round_robin, random or least_loaded")
        if min(self.replicas, self.prefill_instances, self.decode_instances) < 1:
            raise ValueError("instance counts must be >= 1")
        if min(self.tp, self.tp_prefill, self.tp_decode) < 1:
            raise ValueError("tensor-parallel sizes must be >= 1")

    @property
    def gpus(self) -> int:
        if self.mode == "collocated":
            return self.replicas * self.tp
        return self.prefill_instances * self.tp_prefill + self.decode_instances * self.tp_decode

    def roofline(self, tp: int) -> Roofline:
        if self.steps is not None:
            return ProfiledRoofline(self.model, self.gpu, self.steps, tp=tp)
        return Roofline(self.model, self.gpu, self.eff, tp=tp, combine=self.combine)

    def label(self) -> str:
        if self.mode == "collocated":
            return f"{self.replicas}x collocated TP{self.tp} (budget {self.sched.budget})"
        return f"{self.prefill_instances}P(TP{self.tp_prefill}):{self.decode_instances}D(TP{self.tp_decode})"
