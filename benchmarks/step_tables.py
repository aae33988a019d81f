"""The engines' steps (`--step-log FILE`) set beside the simulator's, per role and by the
tokens a step computed, and each load level's time to first token split by the server's
phases (benchmarks/bench_sim_predicts_bench.py)."""

from __future__ import annotations

import numpy as np

from splitserve.protocol.step_record import StepRecord
from splitserve.protocol.timeline import DECODE, PHASES
from splitserve.sim.result import SimResult, StepTrace

STEP_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # tokens a step computed: lower edges
FIRST_TOKEN_PHASES = PHASES[: PHASES.index(DECODE)]  # the server's phases before the first chunk


def step_deltas(real: list[StepRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Each record's engine-thread CPU and wait for a core since its process's previous
    record (NaN for a process's first, and where the kernel kept no wait)."""
    cpu, wait = np.full(len(real), np.nan), np.full(len(real), np.nan)
    previous: dict[int, StepRecord] = {}
    for i, r in enumerate(real):
        if (p := previous.get(r.pid)) is not None:
            cpu[i] = r.thread_cpu_s - p.thread_cpu_s
            if r.thread_wait_s is not None and p.thread_wait_s is not None:
                wait[i] = r.thread_wait_s - p.thread_wait_s
        previous[r.pid] = r
    return cpu, wait


def step_rows(real: list[StepRecord], simulated: list[tuple[str, StepTrace]]) -> list[str]:
    """The engines' steps (`engine --step-log`) beside the simulator's, per role and by the
    tokens a step computed: how many, their median and mean length, and of the real ones
    the mean the engine thread spent waiting runnable for a core (from its previous step's
    end: preempted by the other processes). Without a prefill tier, `up`'s decode engine
    prefills too: the simulator's collocated ("both") engine."""
    if not any(r.role == "prefill" for r in real):
        real = [r._replace(role="both") if r.role == "decode" else r for r in real]
    header = ("tokens", "steps real/sim", "p50 ms real/sim", "mean ms real/sim", "wait ms real")
    widths = (10, 16, 18, 18, 13)
    rows = [f"{'role':8s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, widths, strict=True))]
    all_cpu, all_wait = step_deltas(real)
    for role in sorted({r.role for r in real} | {role for role, _ in simulated}):
        mine = np.array([r.role == role for r in real], dtype=bool)
        real_tokens = np.array([r.tokens for r in real], dtype=np.int64)[mine]
        real_s = np.array([r.step_s for r in real])[mine]
        cpu, wait = all_cpu[mine], all_wait[mine]
        sim_tokens = np.concatenate([t.tokens for rl, t in simulated if rl == role] or [np.zeros(0)])
        sim_s = np.concatenate([t.lengths for rl, t in simulated if rl == role] or [np.zeros(0)])
        for lo, hi in zip(STEP_BINS, (*STEP_BINS[1:], 1 << 62), strict=True):
            in_bin = (real_tokens >= lo) & (real_tokens < hi)
            a, b = real_s[in_bin], sim_s[(sim_tokens >= lo) & (sim_tokens < hi)]
            if not len(a) and not len(b):
                continue
            p50 = "/".join(f"{np.median(x) * 1e3:.2f}" if len(x) else "-" for x in (a, b))
            mean = "/".join(f"{x.mean() * 1e3:.2f}" if len(x) else "-" for x in (a, b))
            waited = wait[in_bin][~np.isnan(wait[in_bin])]
            w = f"{waited.mean() * 1e3:.2f}" if len(waited) else "-"
            span = f"{lo}-{hi - 1}" if hi - lo > 1 else f"{lo}"
            rows.append(f"{role:8s} {span:>10s} {f'{len(a)}/{len(b)}':>16s} {p50:>18s} {mean:>18s} {w:>13s}")
        rows.append(f"{role:8s} {'busy s':>10s} {f'{real_s.sum():.2f}/{sim_s.sum():.2f}':>16s}")
        rows.append(
            f"{role:8s} {'':>10s} real: the engine thread's CPU {np.nansum(cpu):.2f} s, waiting for a core "
            f"{np.nansum(wait):.2f} s"
        )
    return rows


def ttft_part_rows(run: dict, simulated: list[SimResult]) -> list[str]:
    """Per load level of a bench run, the median time to first token, the simulator's beside
    it, and the medians of the server's phases before the first chunk (`splitserve_timeline`,
    bench records it) and of what lies outside them: the client, the connection and the
    first chunk's way out. Which part a misprediction sits in, where the server timed it."""
    rows: list[str] = []
    for level, sim in zip(run["levels"], simulated, strict=True):
        timed = [q for q in level["requests"] if not q["warmup"] and q["ttft"] and q.get("timeline")]
        if not timed:
            continue
        keep = np.arange(len(sim.ttft)) >= level["load"]["warmup"]
        parts = {
            name: float(np.median([q["timeline"].get(name) or 0.0 for q in timed])) * 1e3
            for name in FIRST_TOKEN_PHASES
            if any(name in q["timeline"] for q in timed)
        }
        served = [sum(q["timeline"].get(name) or 0.0 for name in FIRST_TOKEN_PHASES) for q in timed]
        outside = np.median([q["ttft"] - s for q, s in zip(timed, served, strict=True)]) * 1e3
        ttft, predicted = np.median([q["ttft"] for q in timed]) * 1e3, np.median(sim.ttft[keep]) * 1e3
        shown = " ".join(f"{name} {ms:.1f}" for name, ms in parts.items())
        rows.append(
            f"{level['load']['rate']:>6g} req/s  TTFT p50 ms real/sim {ttft:.1f}/{predicted:.1f}"
            f"  server (medians): {shown}; outside {outside:.1f}"
        )
    return rows
