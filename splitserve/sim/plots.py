"""Plots (matplotlib imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def attainment_vs_rate(
    path: str, panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]], target: float
) -> None:
    """One panel per SLO, one line per design: SLO attainment against offered rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels.items(), strict=True):
        for name, pts in curves.items():
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"{target:.0%} target")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("requests meeting the SLO (%)")
        ax.set_ylim(-3, 103)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def itl_cdf(path: str, series: Mapping[str, np.ndarray], title: str) -> None:
    """Empirical CDF of inter-token gaps, one line per design (log x axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, gaps in series.items():
        if len(gaps) == 0:
            continue
        x = np.sort(gaps) * 1e3
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token gap (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
