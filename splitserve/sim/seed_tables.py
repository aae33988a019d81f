"""The seed's simulated tables, cell by cell, from the seed's own arrival stream.

The seed's `serving_sim` draws each run's 100 arrivals as `random.Random(seed).expovariate`
for seeds 0-4; splitserve.goodput's arrival process draws exactly that stream, so the
seed's preset sees the very requests the seed simulated. A cell passes when it is within
5% of the seed's figure or within half a unit of the digit the seed prints (attainments
are printed as whole percents: within 5 points)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from splitserve.goodput import SLO_AVERAGE, SLO_WORST_GAP, distserve_goodput
from splitserve.sim.deployment import Deployment, KVLink
from splitserve.sim.metrics import met
from splitserve.sim.simulator import simulate
from splitserve.sim.specs import load_gpu, load_model
from splitserve.sim.workload import synthetic

SEEDS = 5
REQUESTS = 100
TOLERANCE = 0.05

# (rate) -> per design (median TTFT s, ITL p50 ms, ITL p99 ms): the seed's serving table
SERVING = {
    0.2: ((0.72, 25, 26), (2.04, 25, 27), (0.76, 25, 27)),
    0.4: ((0.75, 25, 174), (2.05, 26, 29), (0.77, 26, 29)),
    0.6: ((0.75, 26, 184), (2.06, 27, 30), (0.78, 27, 30)),
    1.0: ((0.76, 28, 194), (2.28, 29, 32), (1.00, 29, 32)),
    1.5: ((0.76, 31, 194), (4.20, 32, 33), (2.92, 32, 33)),
    2.0: ((0.83, 37, 194), (10.45, 33, 33), (9.17, 33, 33)),
}
GOODPUT_RATES = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5)
# SLO -> per design (attainment % at each rate, goodput req/s): the seed's goodput tables
GOODPUT = {
    "A": (((97, 75, 46, 23, 10, 5, 3), 0.2), ((0,) * 7, 0.0), ((100, 99, 95, 88, 73, 41, 11), 0.6)),
    "B": (((65, 29, 11, 5, 3, 2, 2), 0.0), ((0,) * 7, 0.0), ((100, 99, 97, 92, 87, 76, 37), 0.8)),
}
# (rate, budget) -> (median TTFT s, p99 ITL ms, worst gap ms): the seed's chunk sweep
SWEEP = {
    (0.4, 512): (0.77, 49, 51),
    (0.4, 1024): (0.76, 94, 99),
    (0.4, 2048): (0.75, 174, 194),
    (0.4, 4096): (0.74, 89, 376),
    (0.4, 8192): (0.74, 28, 710),
    (1.0, 512): (0.78, 51, 51),
    (1.0, 1024): (0.77, 99, 99),
    (1.0, 2048): (0.76, 194, 194),
    (1.0, 4096): (0.75, 376, 376),
    (1.0, 8192): (0.75, 710, 710),
}
DESIGNS = ("collocated", "P/D, 1.3 s transfer", "P/D, 20 ms transfer")


class Cell(NamedTuple):
    table: str
    row: str
    column: str
    seed: float
    ours: float
    half_unit: float  # half the unit of the last digit the seed prints

    @property
    def ok(self) -> bool:
        return abs(self.ours - self.seed) <= max(TOLERANCE * abs(self.seed), self.half_unit)


def seed_designs() -> list[Deployment]:
    model, gpu = load_model("Qwen2.5-7B"), load_gpu("L40S")
    col = Deployment(model, gpu)
    return [
        col,
        Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=1.3)),
        Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=0.02)),
    ]


def _runs(dep: Deployment, rate: float, tick: Callable[[], None] | None):
    for s in range(SEEDS):
        yield simulate(dep, synthetic(rate, REQUESTS, 8192, 256, seed=s), seed=s)
        if tick:
            tick()


def serving_cells(tick: Callable[[], None] | None = None) -> list[Cell]:
    cells = []
    for dep, name, col in ((d, n, i) for i, (d, n) in enumerate(zip(seed_designs(), DESIGNS, strict=True))):
        for rate, row in SERVING.items():
            sm = [r.summary() for r in _runs(dep, rate, tick)]
            ttft, p50, p99 = (
                float(np.mean([x[k] for x in sm])) for k in ("ttft_median_s", "itl_p50_s", "itl_p99_s")
            )
            seed_ttft, seed_p50, seed_p99 = row[col]
            label = f"{rate:g} req/s"
            cells += [
                Cell("serving", label, f"{name}: TTFT s", seed_ttft, ttft, 0.005),
                Cell("serving", label, f"{name}: ITL p50 ms", seed_p50, p50 * 1e3, 0.5),
                Cell("serving", label, f"{name}: ITL p99 ms", seed_p99, p99 * 1e3, 0.5),
            ]
    return cells


def goodput_cells(tick: Callable[[], None] | None = None) -> list[Cell]:
    cells = []
    for col, (dep, name) in enumerate(zip(seed_designs(), DESIGNS, strict=True)):
        att = {"A": [], "B": []}
        for rate in GOODPUT_RATES:
            runs = list(_runs(dep, rate, tick))
            att["A"].append(float(np.mean([met(SLO_AVERAGE, r).mean() for r in runs])))
            att["B"].append(float(np.mean([met(SLO_WORST_GAP, r).mean() for r in runs])))
        for slo in ("A", "B"):
            seed_row, seed_gp = GOODPUT[slo][col]
            for rate, want, got in zip(GOODPUT_RATES, seed_row, att[slo], strict=True):
                cells.append(Cell(f"goodput {slo}", name, f"{rate:g} req/s, %", want, got * 100, 0.5))
            ours = distserve_goodput(GOODPUT_RATES, att[slo], 0.9)
            cells.append(Cell(f"goodput {slo}", name, "goodput req/s", seed_gp, ours, 0.0))
    return cells


def sweep_cells(tick: Callable[[], None] | None = None) -> list[Cell]:
    col = seed_designs()[0]
    cells = []
    for (rate, budget), (ttft, p99, worst) in SWEEP.items():
        dep = Deployment(col.model, col.gpu, sched=col.sched.with_budget(budget))
        runs = list(_runs(dep, rate, tick))
        sm = [r.summary() for r in runs]
        row = f"{rate:g} req/s, budget {budget}"
        cells += [
            Cell(
                "chunk sweep",
                row,
                "median TTFT s",
                ttft,
                float(np.mean([x["ttft_median_s"] for x in sm])),
                0.005,
            ),
            Cell(
                "chunk sweep", row, "p99 ITL ms", p99, float(np.mean([x["itl_p99_s"] for x in sm])) * 1e3, 0.5
            ),
            Cell(
                "chunk sweep",
                row,
                "worst gap ms",
                worst,
                float(np.mean([r.worst_gap.max() for r in runs])) * 1e3,
                0.5,
            ),
        ]
    return cells


def all_cells(tick: Callable[[], None] | None = None) -> list[Cell]:
    return serving_cells(tick) + goodput_cells(tick) + sweep_cells(tick)


RUNS = SEEDS * (len(SERVING) * 3 + len(GOODPUT_RATES) * 3 + len(SWEEP))  # for a progress bar
