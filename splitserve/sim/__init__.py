"""splitserve.sim: specs, roofline, discrete-event serving simulator, goodput and planner.

Imports only the standard library, numpy and its own modules (matplotlib lazily, for plots),
plus the torch-free definitions it shares with the rest of splitserve: `splitserve.config`
(scheduler and transfer configs) and `splitserve.goodput` (SLOs, goodput, arrivals).

    from splitserve.sim import Deployment, KVLink, simulate, synthetic, load_model, load_gpu
    dep = Deployment(load_model("Qwen2.5-7B"), load_gpu("L40S"), mode="pd", link=KVLink(fixed_s=0.02))
    result = simulate(dep, synthetic(rate=0.4, n=100, prompt=8192, output=256, seed=0))
    result.summary()  # median TTFT, ITL p50/p99, ...
"""

from splitserve.sim.deployment import Deployment, KVLink
from splitserve.sim.engine import InstanceConfig
from splitserve.sim.metrics import goodput
from splitserve.sim.result import SimResult
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.simulator import simulate
from splitserve.sim.specs import GPUS, MODELS, GPUSpec, ModelSpec, load_gpu, load_model, model_from_hf_config
from splitserve.sim.steady import SteadyState, estimate, search_goodput
from splitserve.sim.workload import Workload, load_trace, sessions, synthetic

__all__ = [
    "GPUS",
    "MODELS",
    "Deployment",
    "Efficiency",
    "GPUSpec",
    "InstanceConfig",
    "KVLink",
    "ModelSpec",
    "Roofline",
    "SimResult",
    "SteadyState",
    "Workload",
    "estimate",
    "goodput",
    "load_gpu",
    "load_model",
    "load_trace",
    "model_from_hf_config",
    "search_goodput",
    "sessions",
    "simulate",
    "synthetic",
]
