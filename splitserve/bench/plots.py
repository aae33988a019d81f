"""`--plot FILE.png`: one figure, three panels (matplotlib is imported only here).

1. SLO attainment vs offered rate, one line per target, the required attainment dashed.
2. The CDF of inter-token gaps at each rate (log time axis): a long right tail is stalls.
3. The token-arrival timeline of the requests at the highest rate with the worst stalls:
   one row per request, a tick per output chunk, gaps above the stall threshold in red.

`write_comparison_plot` draws several servers' attainment curves side by side.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path

from splitserve.bench.metrics import RequestRecord
from splitserve.bench.report import rate_label
from splitserve.bench.runner import BenchResult

_TIMELINE_REQUESTS = 12
_DEFAULT_STALL = 0.1  # seconds: roughly when a reader notices a stutter (the seed's target)


def stall_threshold(result: BenchResult) -> float:
    bounds = [slo.gap for slo in result.slos if slo.gap is not None]
    return min(bounds) if bounds else _DEFAULT_STALL


def write_plot(result: BenchResult, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (attain, cdf, timeline) = plt.subplots(1, 3, figsize=(18, 5.5))
    levels = result.levels
    rates = [level.load.rate for level in levels]
    finite = [r for r in rates if not math.isinf(r)]
    # An unbounded rate is drawn one step past the highest finite rate.
    shown = [(max(finite, default=1.0) * 1.25 if math.isinf(r) else r) for r in rates]

    for slo in result.slos:
        attain.plot(
            shown, [lvl.summary.attainment[slo.name] * 100 for lvl in levels], marker="o", label=slo.name
        )
    attain.axhline(result.required_attainment * 100, color="grey", linestyle="--", label="required")
    attain.set(xlabel="offered rate (req/s)", ylabel="requests meeting the target (%)", ylim=(0, 105))
    attain.set_title("SLO attainment vs rate")
    attain.legend(fontsize=8)

    for rate, level in zip(rates, levels, strict=True):
        gaps = sorted(g * 1e3 for r in level.records if r.ok and not r.warmup for g in r.gaps)
        if gaps:
            cdf.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=f"rate {rate_label(rate)}")
    cdf.axvline(stall_threshold(result) * 1e3, color="red", linestyle=":", label="stall threshold")
    cdf.set(xlabel="inter-token gap (ms)", ylabel="fraction of gaps", xscale="log")
    cdf.set_title("ITL CDF")
    cdf.legend(fontsize=8)

    _draw_timeline(timeline, levels[-1].records if levels else [], stall_threshold(result))
    timeline.set_title(
        f"token arrivals at rate {rates[-1]:g}/s (worst stalls)" if rates else "token arrivals"
    )

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _draw_timeline(axes, records: list[RequestRecord], threshold: float) -> None:  # axes: matplotlib Axes
    chosen = sorted((r for r in records if r.ok and not r.warmup), key=lambda r: r.worst_gap, reverse=True)
    chosen = sorted(chosen[:_TIMELINE_REQUESTS], key=lambda r: r.start)
    for row, record in enumerate(chosen):
        arrivals = [record.start + t for t in record.chunk_times]
        axes.plot([record.start, arrivals[-1]], [row, row], color="lightgrey", linewidth=1)
        axes.plot(arrivals, [row] * len(arrivals), "|", color="tab:blue", markersize=6)
        for before, after in itertools.pairwise(arrivals):
            if after - before > threshold:
                axes.plot([before, after], [row, row], color="red", linewidth=3)
    axes.set(xlabel="time since the run started (s)", ylabel="request")
    axes.set_yticks(range(len(chosen)), [str(r.request_id) for r in chosen])


def write_comparison_plot(results: Mapping[str, BenchResult], path: str | Path) -> None:
    """Several servers' sweeps of the same targets: one panel per target, attainment vs
    offered rate, a line per server, the required attainment dashed (the headline figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = next(iter(results.values())).slos
    figure, panels = plt.subplots(1, len(slos), figsize=(6.5 * len(slos), 5), squeeze=False)
    for slo, panel in zip(slos, panels[0], strict=True):
        for name, result in results.items():
            rates = [level.load.rate for level in result.levels]
            attained = [level.summary.attainment[slo.name] * 100 for level in result.levels]
            panel.plot(rates, attained, marker="o", label=name)
        panel.axhline(next(iter(results.values())).required_attainment * 100, color="grey", linestyle="--")
        panel.set(xlabel="offered rate (req/s)", ylabel="requests meeting the target (%)", ylim=(0, 105))
        panel.set_title(slo.label())
        panel.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
