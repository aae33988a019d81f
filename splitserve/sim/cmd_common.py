"""Helpers shared by the `splitserve sim` commands: output (table or JSON), progress bar,
argument checks."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator

import numpy as np

from splitserve.sim.roofline import Efficiency


def clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return clean(obj.item())
    return obj


def emit(args: argparse.Namespace, data: object, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(clean(data), indent=1))
    else:
        print("\n".join(lines))
    return 0


@contextlib.contextmanager
def progress(args: argparse.Namespace, total: int, what: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr, silent under --json."""
    if args.json or total <= 1:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


def efficiency(args: argparse.Namespace) -> Efficiency:
    return Efficiency(
        args.eff_compute,
        args.eff_bandwidth,
        args.overhead_ms / 1e3,
        args.eff_attention,
        args.per_seq_overhead_ms / 1e3,
    )


def require_positive(**values: float) -> None:
    for name, v in values.items():
        if v is None or not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
