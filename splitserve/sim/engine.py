"""One simulated serving instance: a continuous-batching scheduler stepping on roofline time.

Roles: "both" (collocated: decodes first, then prefill chunks fill the step's token budget),
"prefill" (prompts only; a finished prompt is handed to the simulator) and "decode" (joins
requests whose KV has arrived at the next step boundary).

Speed: a running request emits one token on every step of its instance until it finishes,
so its token times are a contiguous slice of the instance's step end times. Only step times
are stored, and runs of decode-only steps between two events are computed in one numpy
call; a new arrival cuts such a run at the first step boundary after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from splitserve.config import SchedulerConfig
from splitserve.sim.profile import StreamCpu
from splitserve.sim.result import StepTrace
from splitserve.sim.roofline import ZERO, Cost, Roofline
from splitserve.sim.step_waits import StepWaits


@dataclass(frozen=True)
class InstanceConfig:
    """One simulated instance's scheduler: splitserve's own `SchedulerConfig` (the token budget
    per step, decodes included, and the cap on running sequences) and what the simulator
    models around it."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    chunked_prefill: bool = True  # False: a prompt runs whole in one step (the seed's prefill instance)
    prompts_per_step: int | None = None  # prompts advanced per step; None: as many as fit (vLLM)
    kv_capacity_tokens: int | None = None  # None: unlimited; else reserve prompt+output at admission
    max_run_steps: int | None = None  # cap on decode steps computed in one go (1: step by step)
    # a hybrid model's Mamba state slot, in tokens of KV: reserved beside each request's tokens
    state_tokens_per_request: int = 0

    def __post_init__(self) -> None:
        if self.scheduler.max_num_batched_tokens < 1 or self.scheduler.max_num_seqs < 1:
            raise ValueError("the token budget and max_num_seqs must be >= 1")
        if self.prompts_per_step is not None and self.prompts_per_step < 1:
            raise ValueError("prompts_per_step must be >= 1")
        if self.state_tokens_per_request < 0:
            raise ValueError("state_tokens_per_request must be >= 0")

    def reservation(self, prompt: int, output: int) -> int:
        """KV memory, in tokens, one request holds from admission to its end: its tokens and,
        for a hybrid model, its Mamba state slot."""
        return int(prompt + output) + self.state_tokens_per_request

    def fits_ever(self, prompt: int, output: int) -> bool:
        cap = self.kv_capacity_tokens
        return cap is None or self.reservation(prompt, output) <= cap

    @property
    def budget(self) -> int | None:
        """Tokens per step, decodes included; None: no limit (whole prompts)."""
        return self.scheduler.max_num_batched_tokens if self.chunked_prefill else None

    def with_budget(self, budget: int) -> InstanceConfig:
        return replace(self, scheduler=replace(self.scheduler, max_num_batched_tokens=budget))


class Engine:
    """State of one instance. The simulator calls `enqueue`, `plan` and `finish_step`."""

    def __init__(
        self,
        index: int,
        role: str,
        roofline: Roofline,
        sched: InstanceConfig,
        prompt: np.ndarray,
        output: np.ndarray,
        stream_cpu: StreamCpu = StreamCpu(),
        waits: StepWaits | None = None,
        seed: int = 0,
    ) -> None:
        self.index, self.role, self.roofline, self.sched = index, role, roofline, sched
        self._prompt, self._output = prompt, output
        # the serving path's CPU per step that streams tokens and per token (a prefill
        # worker streams none)
        self.stream_cpu = stream_cpu if role != "prefill" else StreamCpu()
        self.waits = waits
        self.spread = np.array(waits.spread(role) if waits else ())
        self.rng = np.random.default_rng([seed, index])  # draws from `spread`, one per step
        # whether another engine was stepping when its step began: which of the fitted
        # waits its step takes (set by the simulator before each step is planned)
        self.others_stepping = False
        self.serving_done_s = 0.0  # the tiers' CPU of the work finish_step last accounted for
        self._serving_per_step_s = 0.0  # of the in-flight step (each step of a run)
        self.cpu_debt_s = 0.0  # time lost to the tiers' CPU since its last step began
        # the share of the tiers' CPU of its streams that runs on its own cores: set by the
        # simulator before each step is planned, kept for the step in flight
        self.tiers_share = 1.0
        # the tiers' CPU that went to this engine's cores while it was idle, not yet run
        self.idle_backlog_s = 0.0
        self.idle_backlog_at = 0.0
        self.step_chunks: list[np.ndarray] = []  # step end times, appended in order
        self.step_lengths: list[np.ndarray] = []  # and how long each step took
        self.step_token_counts: list[int] = []  # the tokens each of those steps computed, per chunk
        self._step_start = 0.0
        self.n_steps = 0
        self.waiting: deque[list] = deque()  # [rid, tokens done, prompt tokens, reserved?]
        self.ready: deque[int] = deque()  # decode role: KV arrived, waiting to join
        self.pulls: list[int] = []  # decode role, pull mode: transfers to start at its next step boundary
        self.run_ids: list[int] = []
        self.run_left: list[int] = []
        self.run_ctx: list[int] = []
        self.reserved = 0
        self.busy_until: float | None = None  # end of the in-flight step or run
        self.version = 0  # bumps when the in-flight work is replaced (stale events are dropped)
        self._run_times: np.ndarray | None = None  # in-flight decode-only run
        self._chunks: list[tuple[int, int, int]] = []  # in-flight mixed step: (rid, tokens, past)
        self.busy_s = 0.0  # time spent stepping before `window_end` (the last open-loop arrival)
        self.window_end = float("inf")
        self.peak_reserved = 0
        self.kv_blocked_s = 0.0  # time (within the window) some request waited for KV memory
        self._blocked = False  # this step was planned with a request left waiting for memory

    # ---- load ---------------------------------------------------------------------------
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.ready) + len(self.pulls) + len(self.run_ids)

    def idle(self) -> bool:
        """Neither stepping nor holding work to step on."""
        return self.busy_until is None and not self.outstanding()

    def enqueue_prefill(self, rid: int, cached: int) -> None:
        self.waiting.append([rid, cached, int(self._prompt[rid]), False])

    def charge_cpu(self, seconds: float) -> None:
        """Time the tiers around the engine took from it (their CPU on its cores): its
        next step takes that much longer."""
        self.cpu_debt_s += seconds

    def backlog_at(self, now: float, cores: float) -> float:
        """The idle backlog left at `now`, its `cores` having run it since it last grew
        (they were idle: the backlog only grows while the engine is)."""
        return max(0.0, self.idle_backlog_s - (now - self.idle_backlog_at) * cores)

    def cut_run(self, now: float) -> float | None:
        """New work arrived at `now` during a decode-only run: end the run at the first step
        boundary at or after `now`. Returns the new end time if it moved, else None."""
        times = self._run_times
        if times is None or self.busy_until is None or now >= self.busy_until:
            return None
        k = int(np.searchsorted(times, now, side="left"))
        if k >= len(times) - 1:
            return None
        self._run_times = times[: k + 1]
        self.busy_s -= self._in_window(float(times[k]), self.busy_until)
        if self._blocked:
            self.kv_blocked_s -= self._in_window(float(times[k]), self.busy_until)
        self.busy_until = float(times[k])
        self.version += 1
        return self.busy_until

    # ---- planning -----------------------------------------------------------------------
    def _fits(self, rid: int) -> bool:
        cap = self.sched.kv_capacity_tokens
        need = self._need(rid)
        if cap is None or self.reserved + need <= cap:
            return True
        self._blocked = True
        return False

    def _need(self, rid: int) -> int:
        return self.sched.reservation(int(self._prompt[rid]), int(self._output[rid]))

    def _reserve(self, rid: int) -> None:
        self.reserved += self._need(rid)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def kv_peak_fraction(self) -> float:
        cap = self.sched.kv_capacity_tokens
        return self.peak_reserved / cap if cap else 0.0

    def plan(self, now: float, admitted: Callable[[int, int], None]) -> float | None:
        """Start the next step (or run of decode steps) at `now`; returns its end time.
        `admitted(rid, first_step)` is told when a decode-role request joins the batch."""
        self._chunks, self._run_times = [], None
        self._blocked = False
        if self.role == "decode":
            seqs = self.sched.scheduler.max_num_seqs
            while self.ready and len(self.run_ids) < seqs and self._fits(self.ready[0]):
                rid = self.ready.popleft()
                self._reserve(rid)
                self.run_ids.append(rid)
                self.run_left.append(int(self._output[rid]))
                self.run_ctx.append(int(self._prompt[rid]))
                admitted(rid, self.n_steps)
        if self.role != "decode" or self.waiting:  # decode prefills what stays local (P/D)
            self._plan_chunks()
        batch = len(self.run_ids)
        if not self._chunks and batch == 0:
            self.busy_until = None
            return None
        self._step_start = now
        ctx = float(sum(self.run_ctx))
        # the tiers share the engine's cores: each streamed token's serving-path time, and
        # what they spent since the last step began, lengthen its steps
        debt, self.cpu_debt_s = self.cpu_debt_s, 0.0
        c = self.stream_cpu
        waits = self.waits.terms(self.role, self.others_stepping) if self.waits else None
        if self._chunks:
            cost: Cost = self.roofline.decode(batch, ctx) if batch else ZERO
            streamed = batch
            for rid, n, past in self._chunks:
                cost = cost + self.roofline.prefill(n, past=past)
                streamed += past + n >= int(self._prompt[rid])
            self._serving_per_step_s = c.shared_s(streamed)
            compute = self.roofline.step_s(cost)
            waited = waits.wait_s(compute, batch, len(self._chunks)) if waits else 0.0
            wall = (compute + waited) * float(self.spread_factors(1)[0])
            end = now + wall + debt + c.stall_s(streamed, self.tiers_share)
        else:
            steps = min(self.run_left)
            if self.sched.max_run_steps is not None:
                steps = min(steps, self.sched.max_run_steps)
            durations = self.roofline.decode_times(batch, ctx + batch * np.arange(steps))
            self._serving_per_step_s = c.shared_s(batch)
            durations += c.stall_s(batch, self.tiers_share)
            if waits:
                durations += waits.wait_s(durations, batch, 0)
            durations *= self.spread_factors(steps)
            durations[0] += debt
            self._run_times = now + np.cumsum(durations)
            end = float(self._run_times[-1])
        self.busy_s += self._in_window(now, end)
        if self._blocked:
            self.kv_blocked_s += self._in_window(now, end)
        self.busy_until = end
        return end

    def spread_factors(self, steps: int) -> np.ndarray:
        """What each of the next `steps` steps' modelled time is scaled by: drawn from the
        spread its kind's logged steps had (step_waits.py), else 1."""
        if not len(self.spread):
            return np.ones(steps)
        return self.spread[self.rng.integers(len(self.spread), size=steps)]

    def _in_window(self, start: float, end: float) -> float:
        return max(0.0, min(end, self.window_end) - min(start, self.window_end))

    def _plan_chunks(self) -> None:
        budget = self.sched.budget
        left = (budget - len(self.run_ids)) if budget is not None else None
        limit = self.sched.prompts_per_step
        seqs_left = self.sched.scheduler.max_num_seqs - len(self.run_ids)
        # the engine's long-prefill threshold (Scheduler.prefill_chunk_cap): while any request
        # decodes, a prompt computes at most this many tokens a step
        cap = self.sched.scheduler.long_prefill_token_threshold if self.run_ids else 0
        for entry in self.waiting:
            if left is not None and left <= 0:
                break
            if limit is not None and len(self._chunks) >= limit:
                break
            if len(self._chunks) >= seqs_left:
                break
            rid, done, total, reserved = entry
            if not reserved:
                if not self._fits(rid):
                    break  # first come, first served: later prompts wait behind it
                self._reserve(rid)
                entry[3] = True
            n = total - done if left is None else min(left, total - done)
            if cap:
                n = min(n, cap)
            self._chunks.append((rid, n, done))
            if left is not None:
                left -= n

    # ---- completing ---------------------------------------------------------------------
    def finish_step(self) -> tuple[np.ndarray, list[int], list[int]]:
        """Account for the in-flight work. Returns (step end times, requests whose output
        finished, requests whose prefill finished)."""
        if self._run_times is not None:
            times = self._run_times
        else:
            times = np.array([self.busy_until])
        k = len(times)
        self.serving_done_s = k * self._serving_per_step_s
        self.step_chunks.append(times)
        lengths = np.empty(k)  # np.diff(times, prepend=start), without its cost per call
        lengths[0] = times[0] - self._step_start
        np.subtract(times[1:], times[:-1], out=lengths[1:])
        self.step_lengths.append(lengths)
        self.step_token_counts.append(len(self.run_ids) + sum(n for _, n, _ in self._chunks))
        self.n_steps += k
        finished: list[int] = []
        keep = []
        for i, rid in enumerate(self.run_ids):
            self.run_left[i] -= k
            self.run_ctx[i] += k
            if self.run_left[i] <= 0:
                finished.append(rid)
                self.reserved -= self._need(rid)
            else:
                keep.append(i)
        if finished:
            self.run_ids = [self.run_ids[i] for i in keep]
            self.run_left = [self.run_left[i] for i in keep]
            self.run_ctx = [self.run_ctx[i] for i in keep]
        prefilled: list[int] = []
        for rid, n, _ in self._chunks:
            entry = next(e for e in self.waiting if e[0] == rid)
            entry[1] += n
            if entry[1] >= entry[2]:
                self.waiting.remove(entry)
                prefilled.append(rid)
        self._chunks, self._run_times = [], None
        self.busy_until = None
        return times, finished, prefilled

    def join_after_prefill(self, rid: int) -> bool:
        """Collocated: the step that finished the prompt emitted the first token. Returns
        True if that was the only token (the request is done)."""
        left = int(self._output[rid]) - 1
        if left <= 0:
            self.reserved -= self._need(rid)
            return True
        self.run_ids.append(rid)
        self.run_left.append(left)
        self.run_ctx.append(int(self._prompt[rid]) + 1)
        return False

    def release_prefill(self, rid: int) -> None:
        """Prefill role: the KV left for decode; free its reservation."""
        self.reserved -= self._need(rid)

    def step_times(self) -> np.ndarray:
        return np.concatenate(self.step_chunks) if self.step_chunks else np.zeros(0)

    def steps(self) -> StepTrace:
        """Every step this engine ran: when it ended, how long it took, its tokens."""
        if not self.step_chunks:
            return StepTrace(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
        tokens = [np.full(len(t), n) for t, n in zip(self.step_chunks, self.step_token_counts, strict=True)]
        return StepTrace(self.step_times(), np.concatenate(self.step_lengths), np.concatenate(tokens))
