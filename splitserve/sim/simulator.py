"""Discrete-event serving simulator: collocated replicas, or P/D (N prefill, M decode
instances) with a KV handoff between them.

Per request it records the time to first token, every inter-token gap, TPOT and the worst
gap. The seed's simulator is the default configuration (one prompt advanced per step, whole
prompts on the prefill side, round-robin routing, roofline "max" step times, no memory
limit); each of those is a switch, which is how `seed` vs `realistic` differ.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

import numpy as np

from splitserve.config import TransferConfig
from splitserve.protocol.pd_decision import CostModel, DecisionInputs, decide
from splitserve.sim.engine import Engine, InstanceConfig
from splitserve.sim.kv import exposed_transfer_s, handoff_bytes, transfer_s
from splitserve.sim.profile import CpuCosts
from splitserve.sim.result import SimResult
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.specs import GPUSpec, ModelSpec
from splitserve.sim.step_model import ProfiledRoofline, StepModel
from splitserve.sim.workload import Workload

_ARRIVE, _STEP_END, _KV_READY, _PULL, _ENQ_PREFILL, _AT_ENGINE = range(6)


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


class _Sim:
    def __init__(self, dep: Deployment, wl: Workload, seed: int) -> None:
        self.dep, self.wl = dep, wl
        self.rng = np.random.default_rng(seed + 7919)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.rr = 0
        n = len(wl)
        self.arrive = wl.arrival.astype(float).copy()
        self.first_step = np.full(n, -1, dtype=np.int64)
        self.engine_of = np.full(n, -1, dtype=np.int64)
        self.prefill_of = np.full(n, -1, dtype=np.int64)
        self.finish = np.full(n, np.nan)
        self.cached = np.zeros(n, dtype=np.int64)
        self.rejected = np.zeros(n, dtype=bool)
        self.local = np.zeros(n, dtype=bool)  # P/D: prefilled on decode (conditional disaggregation)
        self.followers: dict[int, list[int]] = {}
        for i, a in enumerate(wl.after):
            if a >= 0:
                self.followers.setdefault(int(a), []).append(i)
        self.engines: list[Engine] = []
        if dep.mode == "collocated":
            self.front = self._make(dep.replicas, "both", dep.tp, dep.sched)
            self.back: list[Engine] = []
        else:
            self.front = self._make(dep.prefill_instances, "prefill", dep.tp_prefill, dep.prefill_sched)
            self.back = self._make(dep.decode_instances, "decode", dep.tp_decode, dep.sched)
        open_loop = wl.arrival[wl.after < 0]
        self.window = float(open_loop.max()) if len(open_loop) and open_loop.max() > 0 else float("inf")
        for e in self.engines:
            e.window_end = self.window

    def _make(self, count: int, role: str, tp: int, sched: InstanceConfig) -> list[Engine]:
        rl = self.dep.roofline(tp)
        if self.dep.kv_limit and sched.kv_capacity_tokens is None and role != "prefill":
            cap, slot = rl.kv_capacity_tokens(self.dep.mem_util), rl.state_slot_tokens()
            sched = replace(sched, kv_capacity_tokens=cap, state_tokens_per_request=slot)
        stream = (self.dep.cpu or CpuCosts()).stream_cpu(self.dep.own_loss)
        made = [
            Engine(len(self.engines) + i, role, rl, sched, self.wl.prompt, self.wl.output, stream)
            for i in range(count)
        ]
        self.engines.extend(made)
        return made

    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    # ---- engines ------------------------------------------------------------------------
    def wake(self, e: Engine, t: float) -> None:
        if e.busy_until is None:
            self.start(e, t)
        else:
            e.tiers_share = self.tiers_share(e, t)
            end = e.cut_run(t)
            if end is not None:
                self.push(end, _STEP_END, e.index, e.version)

    def start(self, e: Engine, t: float) -> None:
        for rid in e.pulls:  # pull mode: the transfer starts when decode next checks
            self.push(t + self.transfer_time(rid), _KV_READY, e.index, rid)
        e.pulls = []

        def admitted(rid: int, step: int) -> None:
            self.first_step[rid], self.engine_of[rid] = step, e.index

        # what the tiers left on its cores while it was idle runs before its step
        e.charge_cpu(self.dep.own_loss * e.backlog_at(t, self.dep.own_loss))
        e.idle_backlog_s = 0.0
        e.tiers_share = self.tiers_share(e, t)
        end = e.plan(t, admitted)
        if end is not None:
            self.push(end, _STEP_END, e.index, e.version)

    def step_end(self, e: Engine, t: float) -> None:
        _, finished, prefilled = e.finish_step()
        if e.serving_done_s > 0 and e.tiers_share < 1:  # its streams' CPU ran elsewhere too
            self.place_tiers_cpu(e, (1 - e.tiers_share) * e.serving_done_s, t)
        for rid in finished:
            self.done(rid, t)
        for rid in prefilled:
            if e.role != "prefill":  # collocated, or a P/D request decode prefilled itself
                self.first_step[rid], self.engine_of[rid] = e.n_steps - 1, e.index
                if e.join_after_prefill(rid):
                    self.done(rid, t)
            else:
                e.release_prefill(rid)
                self.handoff(rid, t)
        self.start(e, t)

    def done(self, rid: int, t: float) -> None:
        self.finish[rid] = t
        for f in self.followers.get(rid, ()):
            self.push(t + float(self.wl.think_s[f]), _ARRIVE, f)

    # ---- routing and handoff ------------------------------------------------------------
    def pick(self, pool: list[Engine]) -> Engine:
        if len(pool) == 1:
            return pool[0]
        if self.dep.routing == "round_robin":
            self.rr += 1
            return pool[(self.rr - 1) % len(pool)]
        if self.dep.routing == "random":
            return pool[int(self.rng.integers(len(pool)))]
        return min(pool, key=lambda e: (e.outstanding(), e.index))

    def arrive_at(self, rid: int, t: float) -> None:
        wl, dep = self.wl, self.dep
        prev = int(wl.after[rid])
        prompt = int(wl.prompt[rid])
        fresh = prev >= 0 and t - self.finish[prev] <= dep.prefix_ttl_s
        if dep.mode == "collocated":
            sticky = fresh and self.engine_of[prev] >= 0
            e = self.engines[int(self.engine_of[prev])] if sticky else self.pick(self.front)
            cached = int(wl.prefix[rid]) if sticky else 0
            self.enqueue_prefill(e, rid, min(cached, prompt - 1), t)
            self.wake(e, t)
            return
        sticky = fresh and self.prefill_of[prev] >= 0
        if not sticky and dep.pd_costs is not None and self.prefill_locally(rid, t):
            return
        e = self.engines[int(self.prefill_of[prev])] if sticky else self.pick(self.front)
        self.prefill_of[rid] = e.index
        pull_s = 0.0
        if not sticky:
            cached = 0
        elif dep.bidirectional:  # the answer's blocks come back from decode
            cached = int(wl.prefix[rid])
            pulled = max(0, cached - int(wl.prev_prompt[rid]))
            pull_s = self._link_s(handoff_bytes(dep.model, pulled)) if pulled else 0.0
        else:  # one-way: prefill only holds the previous prompt
            cached = min(int(wl.prefix[rid]), int(wl.prev_prompt[rid]))
        self.cached[rid] = min(cached, prompt - 1)
        if pull_s > 0:
            self.push(t + pull_s, _ENQ_PREFILL, e.index, rid)
        else:
            self.enqueue_prefill(e, rid, int(self.cached[rid]), t)
            self.wake(e, t)

    def enqueue_prefill(self, e: Engine, rid: int, cached: int, t: float) -> None:
        """`rid`'s prompt onto `e`; the tiers' CPU for it (more on the P/D path) is charged,
        and `e`'s own (its API; a prefill worker's KV push) to `e`, on its own cores."""
        e.enqueue_prefill(rid, cached)
        if (cpu := self.dep.cpu) is not None:
            remote = e.role == "prefill"
            own = cpu.prefill_engine_s_per_request if remote else cpu.engine_s_per_request
            e.charge_cpu(self.dep.own_loss * own)
            self.place_tiers_cpu(None, cpu.cpu_s_per_request + remote * cpu.cpu_s_per_remote_request, t)

    def place_tiers_cpu(self, source: Engine | None, cpu_s: float, t: float) -> None:
        """The tiers spent `cpu_s` of CPU at `t` (`source`'s streams: its share is in its
        own steps). It runs where a core is free: on an idle engine's cores, which run it
        before that engine's next step; with none idle, beside the busy engines, each losing
        `own_loss` seconds per second of its share (`tiers_shares`)."""
        if cpu_s <= 0:
            return
        idle = [o for o in self.engines if o is not source and o.idle()]
        if idle:
            o = min(idle, key=lambda o: (o.backlog_at(t, self.dep.own_loss), o.index))
            o.idle_backlog_s, o.idle_backlog_at = o.backlog_at(t, self.dep.own_loss) + cpu_s, t
            return
        shares = self.tiers_shares(t)
        left = sum(share for o, share in zip(self.engines, shares, strict=True) if o is not source)
        for o, share in zip(self.engines, shares, strict=True):
            if o is not source and left > 0:
                o.charge_cpu(self.dep.own_loss * cpu_s * share / left)

    def tiers_shares(self, t: float) -> list[float]:
        """With every engine busy, the share of the tiers' CPU each one's cores run: the
        tiers' threads stay on the core they last found idle, and find a core idle as often
        as its engine has been idle so far."""
        idle = [max(1e-3, 1.0 - o.busy_s / min(t, o.window_end)) if t > 0 else 1.0 for o in self.engines]
        return [x / sum(idle) for x in idle]

    def tiers_share(self, e: Engine, t: float) -> float:
        """The share of the tiers' CPU for `e`'s streams that runs on `e`'s cores now."""
        if any(o is not e and o.idle() for o in self.engines):
            return 0.0
        return self.tiers_shares(t)[e.index]

    def prefill_locally(self, rid: int, t: float) -> bool:
        """Conditional disaggregation: the decode worker the request would go to prefills
        it when that costs less than the prefill worker and the handoff."""
        d = min(self.back, key=lambda e: (e.outstanding(), e.index))
        queued_on_decode = sum(total - done for _, done, total, _ in d.waiting)
        queued_on_prefill = min(sum(total - done for _, done, total, _ in p.waiting) for p in self.front)
        prompt = int(self.wl.prompt[rid])
        assert self.dep.pd_costs is not None
        inputs = DecisionInputs(prompt, len(d.run_ids), queued_on_decode, queued_on_prefill)
        if decide(inputs, self.dep.pd_costs).remote:
            return False
        self.local[rid] = True
        self.enqueue_prefill(d, rid, 0, t)
        self.wake(d, t)
        return True

    def _link_s(self, num_bytes: float) -> float:
        link = self.dep.link
        return transfer_s(num_bytes, link.gbps, link.overhead_s)

    def transfer_time(self, rid: int) -> float:
        link, model = self.dep.link, self.dep.model
        if link.fixed_s is not None:
            return link.fixed_s
        size = handoff_bytes(model, int(self.wl.prompt[rid]))  # KV, and a hybrid's state, whole
        if self.dep.transfer.mode == "pull":
            return self._link_s(size)
        rl = self.front[0].roofline
        cached = int(self.cached[rid])
        prefill_s = rl.step_s(rl.prefill(int(self.wl.prompt[rid]) - cached, past=cached))
        return exposed_transfer_s(size, model.layers, link.gbps, prefill_s, True) + link.overhead_s

    def handoff(self, rid: int, t: float) -> None:
        d = min(self.back, key=lambda e: (e.outstanding(), e.index))
        if not d.sched.fits_ever(int(self.wl.prompt[rid]), int(self.wl.output[rid])):
            self.rejected[rid] = True
            return
        if self.dep.transfer.mode == "pull" and self.dep.link.fixed_s is None:
            self.push(t, _PULL, d.index, rid)
        else:
            self.push(t + self.transfer_time(rid), _KV_READY, d.index, rid)

    # ---- main loop ----------------------------------------------------------------------
    def run(self) -> SimResult:
        wl = self.wl
        for i in np.flatnonzero(wl.after < 0):
            self._check_fits(int(i))
            if not self.rejected[i]:
                self.push(float(wl.arrival[i]), _ARRIVE, int(i))
        while self.heap:
            t, _, kind, a, b = heapq.heappop(self.heap)
            if kind == _ARRIVE:
                self._check_fits(a)
                if self.rejected[a]:
                    continue
                self.arrive[a] = t
                cpu = self.dep.cpu
                if cpu is not None:  # rendered first: the engine sees it later
                    self.push(t + cpu.delay_s(int(wl.prompt[a])), _AT_ENGINE, a)
                else:
                    self.arrive_at(a, t)
            elif kind == _AT_ENGINE:
                self.arrive_at(a, t)
            elif kind == _STEP_END:
                e = self.engines[a]
                if b == e.version and e.busy_until is not None:
                    self.step_end(e, t)
            elif kind == _KV_READY:  # decode takes in the request and its KV, on its own cores
                if (cpu := self.dep.cpu) is not None:
                    own = cpu.engine_s_per_request + cpu.engine_s_per_remote_request
                    self.engines[a].charge_cpu(self.dep.own_loss * own)
                self.engines[a].ready.append(b)
                self.wake(self.engines[a], t)
            elif kind == _PULL:
                self.engines[a].pulls.append(b)
                self.wake(self.engines[a], t)
            else:  # _ENQ_PREFILL
                e = self.engines[a]
                self.enqueue_prefill(e, b, int(self.cached[b]), t)
                self.wake(e, t)
        return self._collect()

    def _check_fits(self, rid: int) -> None:
        for e in self.engines:
            if not e.sched.fits_ever(int(self.wl.prompt[rid]), int(self.wl.output[rid])):
                self.rejected[rid] = True

    def _collect(self) -> SimResult:
        n = len(self.wl)
        ttft, tpot = np.full(n, np.inf), np.zeros(n)
        worst, e2e = np.zeros(n), np.full(n, np.inf)
        gaps: list[np.ndarray] = [np.zeros(0)] * n
        end_time = 0.0
        tokens = [0] * len(self.engines)
        served: list[int] = []
        token_times: list[np.ndarray] = []
        for e in self.engines:
            times = e.step_times()
            if len(times):
                end_time = max(end_time, float(times[-1]))
            for rid in np.flatnonzero(self.engine_of == e.index):
                s, o = int(self.first_step[rid]), int(self.wl.output[rid])
                tokens[e.index] += o
                served.append(int(rid))
                token_times.append(times[s : s + o])
        for rid, times in zip(served, token_times, strict=True):
            o = len(times)
            first, last = times[0], times[-1]
            ttft[rid] = first - self.arrive[rid]
            e2e[rid] = last - self.arrive[rid]
            gaps[rid] = g = np.diff(times)
            if o > 1:
                tpot[rid] = (last - first) / (o - 1)
                worst[rid] = g.max()
        window = self.window if np.isfinite(self.window) else max(end_time, 1e-9)
        return SimResult(
            arrival=self.arrive,
            ttft=ttft,
            tpot=tpot,
            worst_gap=worst,
            e2e=e2e,
            output=self.wl.output,
            gaps=gaps,
            busy_fraction=[e.busy_s / window for e in self.engines],
            mean_batch=[tokens[e.index] / max(e.n_steps, 1) for e in self.engines],
            rejected=int(self.rejected.sum()),
            kv_peak=[e.kv_peak_fraction() for e in self.engines],
            kv_blocked=[e.kv_blocked_s / window for e in self.engines],
            roles=[e.role for e in self.engines],
            remote=~self.local & ~self.rejected if self.dep.mode == "pd" else None,
            steps=tuple(e.steps() for e in self.engines),
        )


def simulate(dep: Deployment, wl: Workload, seed: int = 0) -> SimResult:
    """Run one workload through one deployment. `seed` only drives random routing."""
    return _Sim(dep, wl, seed).run()
