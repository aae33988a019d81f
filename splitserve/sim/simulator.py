"""Discrete-event serving simulator: collocated replicas, or P/D (N prefill, M decode
instances) with a KV handoff between them.

Per request it records the time to first token, every inter-token gap, TPOT and the worst
gap. The seed's simulator is the default configuration (one prompt advanced per step, whole
prompts on the prefill side, round-robin routing, roofline "max" step times, no memory
limit); each of those is a switch, which is how `seed` vs `realistic` differ.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from splitserve.protocol.pd_decision import DecisionInputs, decide
from splitserve.sim.deployment import Deployment
from splitserve.sim.engine import Engine, InstanceConfig
from splitserve.sim.kv import exposed_transfer_s, handoff_bytes, transfer_s
from splitserve.sim.path_latency import PathLatency
from splitserve.sim.profile import CpuCosts
from splitserve.sim.result import SimResult
from splitserve.sim.workload import Workload

_ARRIVE, _STEP_END, _KV_READY, _PULL, _ENQ_PREFILL, _AT_ENGINE = range(6)
RELAY_STREAM = 1 << 16  # the relay's draws: a random stream apart from the engines' ([seed, index])


class _Sim:
    def __init__(self, dep: Deployment, wl: Workload, seed: int) -> None:
        self.dep, self.wl, self.seed = dep, wl, seed
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
        self.in_flight = 0  # requests arrived and not finished
        self.cached = np.zeros(n, dtype=np.int64)
        self.rejected = np.zeros(n, dtype=bool)
        self.local = np.zeros(n, dtype=bool)  # P/D: prefilled on decode (conditional disaggregation)
        self.followers: dict[int, list[int]] = {}
        for i, a in enumerate(wl.after):
            if a >= 0:
                self.followers.setdefault(int(a), []).append(i)
        self.engines: list[Engine] = []
        # the tiers' CPU is placed on the engines' cores unless fitted waits stand for it
        self.places_cpu = dep.cpu is not None and dep.waits is None
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
        placed = self.dep.cpu if self.places_cpu else CpuCosts()
        stream = placed.stream_cpu(self.dep.own_loss)
        wl, waits, seed = self.wl, self.dep.waits, self.seed
        made = [
            Engine(len(self.engines) + i, role, rl, sched, wl.prompt, wl.output, stream, waits, seed)
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
        e.others_stepping = any(o is not e and o.busy_until is not None for o in self.engines)
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
        self.in_flight -= 1
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
        if (cpu := self.dep.cpu) is not None and self.places_cpu:
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

    def stepping_changed(self, e: Engine, t: float) -> None:
        """`e` began or stopped stepping at `t`: the other engines' decode runs end at their
        next step boundary, so that their next steps take the fitted waits of the new state."""
        for o in self.engines:
            if o is not e and o.busy_until is not None:
                end = o.cut_run(t)
                if end is not None:
                    self.push(end, _STEP_END, o.index, o.version)

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
            self.in_flight -= 1
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
            if self.dep.waits is None:
                self.handle(t, kind, a, b)
                continue
            stepping = [e.busy_until is not None for e in self.engines]
            self.handle(t, kind, a, b)
            for e, was in zip(self.engines, stepping, strict=True):
                if (e.busy_until is not None) != was:
                    self.stepping_changed(e, t)
        return self._collect()

    def handle(self, t: float, kind: int, a: int, b: int) -> None:
        wl = self.wl
        if kind == _ARRIVE:
            self._check_fits(a)
            if self.rejected[a]:
                return
            self.arrive[a] = t
            cpu, path = self.dep.cpu, self.dep.path
            if path is not None:  # the path's time before the engine sees it, at this load
                self.push(t + path.delay_s(self.in_flight), _AT_ENGINE, a)
            elif cpu is not None:  # rendered first: the engine sees it later
                self.push(t + cpu.delay_s(int(wl.prompt[a])), _AT_ENGINE, a)
            else:
                self.arrive_at(a, t)
            self.in_flight += 1
        elif kind == _AT_ENGINE:
            self.arrive_at(a, t)
        elif kind == _STEP_END:
            e = self.engines[a]
            if b == e.version and e.busy_until is not None:
                self.step_end(e, t)
        elif kind == _KV_READY:  # decode takes in the request and its KV, on its own cores
            if (cpu := self.dep.cpu) is not None and self.places_cpu:
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
        if (path := self.dep.path) is not None and (path.relay_fixed_s or path.relay_per_in_flight_s):
            token_times = self.relayed(path, served, token_times)
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

    def relayed(
        self, path: PathLatency, served: list[int], token_times: list[np.ndarray]
    ) -> list[np.ndarray]:
        """Each stream's token times as its client gets them: through the path's relay, at
        the streams in flight as its first token came (sim/path_latency.py)."""
        rng = np.random.default_rng([self.seed, RELAY_STREAM])
        arrivals = np.sort(self.arrive[served])
        lasts = np.sort([times[-1] for times in token_times])
        out = []
        for times in token_times:
            first = times[0]
            streams = int(np.searchsorted(arrivals, first, "left") - np.searchsorted(lasts, first, "left"))
            out.append(path.delivered(times, streams, rng) if len(times) > 1 else times)
        return out


def simulate(dep: Deployment, wl: Workload, seed: int = 0) -> SimResult:
    """Run one workload through one deployment. `seed` drives random routing, the draws
    from a fitted spread of step times (`Deployment.waits`) and from the tokens' relay
    (`Deployment.path`)."""
    return _Sim(dep, wl, seed).run()
