"""benchmarks/step_tables.py's time to first token by the server's phases, on a bench run
of known figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_tables.py"


def step_tables():
    spec = importlib.util.spec_from_file_location("step_tables", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def request(ttft: float, timeline: dict | None, warmup: bool = False) -> dict:
    return {"warmup": warmup, "ttft": ttft, "timeline": timeline}


def test_the_parts_are_medians_of_the_measured_requests_and_the_rest_is_outside():
    timed = [
        request(0.100, {"render": 0.004, "prefill": 0.060, "handoff": 0.002, "decode": 0.300, "send": 0.001}),
        request(0.120, {"render": 0.006, "prefill": 0.080, "handoff": 0.004, "decode": 0.300}),
        request(0.140, {"render": 0.008, "prefill": 0.090, "handoff": 0.006, "decode": 0.300}),
    ]
    warm_up = request(5.0, {"render": 1.0, "prefill": 3.0}, warmup=True)
    untimed = {"load": {"rate": 8.0, "warmup": 0}, "requests": [request(0.2, None)]}
    run = {"levels": [{"load": {"rate": 2.0, "warmup": 1}, "requests": [warm_up, *timed]}, untimed]}
    simulated = [SimpleNamespace(ttft=np.array([9.0, 0.11, 0.13, 0.15])), SimpleNamespace(ttft=np.ones(1))]
    (row,) = step_tables().ttft_part_rows(run, simulated)
    # the warm-up request counts in neither; the phases after the first chunk are left out
    assert "real/sim 120.0/130.0" in row
    assert "render 6.0 prefill 80.0 handoff 4.0;" in row
    assert "decode" not in row and "send" not in row
    # outside: each request's TTFT less its phases before the first chunk (34, 30, 36 ms)
    assert row.endswith("outside 34.0")
