"""How fast is the seed's goodput search (7 rates x 5 seeds x 3 designs, two SLOs: 210 runs of
100 requests) in splitserve's simulator?

Peer, side by side in the same run: the same simulator stepping one decode step at a time
(`max_run_steps=1`), i.e. a plain discrete-event loop without the batched numpy decode runs.
Both must give the same goodput (checked), the ratio says what the batching buys.

    .venv/bin/python benchmarks/bench_sim_goodput.py
"""

from __future__ import annotations

import time
from dataclasses import replace

from splitserve.goodput import SLO_AVERAGE, SLO_WORST_GAP
from splitserve.sim import Deployment, KVLink, goodput, load_gpu, load_model, synthetic

RATES = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5]


def make(rate: float, requests: int, seed: int):
    return synthetic(rate, requests, 8192, 256, seed=seed)


def search(step_by_step: bool) -> tuple[float, float, dict]:
    model, gpu = load_model("Qwen2.5-7B"), load_gpu("L40S")
    designs = {
        "collocated": Deployment(model, gpu),
        "P/D 1.3 s": Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=1.3)),
        "P/D 20 ms": Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=0.02)),
    }
    if step_by_step:
        designs = {k: replace(d, sched=replace(d.sched, max_run_steps=1)) for k, d in designs.items()}
    t0, c0 = time.perf_counter(), time.process_time()
    out = {
        (slo_name, name): goodput(dep, make, slo, RATES, target=0.9, seeds=5).goodput
        for slo_name, slo in (("average", SLO_AVERAGE), ("worst gap", SLO_WORST_GAP))
        for name, dep in designs.items()
    }
    return time.perf_counter() - t0, time.process_time() - c0, out


if __name__ == "__main__":
    fast_s, fast_cpu, fast = search(step_by_step=False)
    slow_s, slow_cpu, slow = search(step_by_step=True)
    for key, value in fast.items():
        print(f"goodput {key[0]:9s} {key[1]:11s} {value:.1f} req/s")
    assert fast == slow, (fast, slow)
    # CPU seconds of this process: the wall time swings with the neighbours on a shared box
    print(f"splitserve sim (batched decode runs): {fast_cpu:.2f} s CPU ({fast_s:.2f} s wall) for 210 runs")
    print(f"peer (one event per decode step):     {slow_cpu:.2f} s CPU ({slow_s:.2f} s wall) for 210 runs")
    print(f"speed-up vs step-by-step (CPU time): {slow_cpu / fast_cpu:.1f}x")
