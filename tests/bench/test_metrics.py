"""Metric definitions on synthetic records whose answers are known by hand."""

from __future__ import annotations

import math

import pytest

from splitserve.bench.metrics import Distribution, RequestRecord, summarize
from splitserve.goodput import SLO, distserve_goodput, interpolated_goodput, parse_duration


def record(
    request_id: int, start: float, times: list[float], tokens: int | None = None, **kw
) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        start=start,
        chunk_times=tuple(times),
        input_tokens=100,
        output_tokens=len(times) if tokens is None else tokens,
        **kw,
    )


def test_record_derived_times():
    r = record(0, 1.0, [0.5, 0.52, 0.54, 0.74, 0.76])
    assert r.ttft == 0.5 and r.e2e == 0.76
    assert r.gaps == pytest.approx([0.02, 0.02, 0.2, 0.02])
    assert sum(r.gaps) == pytest.approx(r.e2e - r.ttft)
    assert r.worst_gap == pytest.approx(0.2)
    assert r.tpot == pytest.approx(0.26 / 4)
    assert r.end == pytest.approx(1.76)
    # Several tokens per chunk: TPOT divides by tokens, gaps stay per chunk.
    packed = record(1, 0.0, [0.1, 0.2], tokens=11)
    assert packed.tpot == pytest.approx(0.01) and packed.gaps == pytest.approx([0.1])
    assert record(2, 0.0, [0.3]).tpot == 0.0  # one token: TPOT 0, as vLLM
    assert RequestRecord.from_json(r.to_json()) == r


@pytest.mark.parametrize(
    ("text", "seconds"), [("2s", 2.0), ("30ms", 0.03), ("500us", 5e-4), ("1.5 s", 1.5), ("1e2ms", 0.1)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["2", "ms", "-1s", "2 hours", ""])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="unit"):
        parse_duration(text)


def test_slo_parse():
    slo = SLO.parse("ttft=2s, tpot=30ms,gap=100ms")
    assert (slo.ttft, slo.tpot, slo.gap, slo.e2e) == (2.0, 0.03, 0.1, None)
    assert slo.name == "ttft=2s,tpot=30ms,gap=100ms"
    assert SLO.parse("e2e=10s").e2e == 10.0
    for bad in ("ttft", "latency=2s", "ttft=2s,ttft=3s", "ttft=2"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


# Ten requests with known TTFT / TPOT / worst gap, checked against three targets.
#   id  ttft   gaps (s)                        tpot    worst   error
KNOWN = [
    record(0, 0.0, [0.5, 0.52, 0.54, 0.56]),  # 0.02  0.02  ok everywhere
    record(1, 0.1, [1.9, 1.92, 1.94, 1.96]),  # 0.02  0.02  ttft 1.9 ok
    record(2, 0.2, [2.5, 2.52, 2.54, 2.56]),  # ttft 2.5 misses every target
    record(3, 0.3, [0.2, 0.25, 0.3, 0.35]),  # tpot 0.05, worst 0.05: misses tpot only
    record(4, 0.4, [0.2, 0.22, 0.42, 0.44]),  # tpot 0.08, worst 0.2: misses tpot and gap
    record(
        5, 0.5, [0.2, 0.21, 0.22, 0.23, 0.24, 0.25, 0.26, 0.27, 0.28, 0.29, 0.44]
    ),  # tpot 0.024, worst 0.15
    record(6, 0.6, [0.3, 0.32], error=None),  # fine
    record(7, 0.7, [], tokens=0, error="HTTP 500: injected"),
    record(8, 0.8, [0.3], tokens=0, error="bad stream: not JSON"),
    record(9, 0.0, [0.1, 0.2, 0.3], warmup=True),  # warm-up: never counted
]


def test_slo_filters_count_known_answers():
    avg = SLO.parse("ttft=2s,tpot=30ms")
    gap = SLO.parse("ttft=2s,gap=100ms")
    ttft_only = SLO.parse("ttft=2s")
    measured = [r for r in KNOWN if not r.warmup]
    assert [r.request_id for r in measured if r.meets(avg)] == [0, 1, 5, 6]
    assert [r.request_id for r in measured if r.meets(gap)] == [0, 1, 3, 6]
    assert [r.request_id for r in measured if r.meets(ttft_only)] == [0, 1, 3, 4, 5, 6]

    summary = summarize(KNOWN, [avg, gap, ttft_only], rate=2.0)
    assert (summary.requests, summary.completed, summary.failed) == (9, 7, 2)
    assert summary.errors == {"HTTP 500": 1, "bad stream": 1}
    assert summary.attainment == {avg.name: 4 / 9, gap.name: 4 / 9, ttft_only.name: 6 / 9}
    # Window: first measured start (0.0) to the last end (record 2: 0.2 + 2.56).
    assert summary.duration == pytest.approx(2.76)
    assert summary.goodput[avg.name] == pytest.approx(4 / 2.76)  # vLLM: good requests per second
    assert summary.request_throughput == pytest.approx(7 / 2.76)
    ok = measured[:7]
    assert summary.output_throughput == pytest.approx(sum(r.output_tokens for r in ok) / 2.76)
    assert summary.ttft.count == 7 and summary.ttft.max == pytest.approx(2.5)
    assert summary.itl.count == sum(len(r.gaps) for r in ok)
    assert summary.worst_gap.max == pytest.approx(0.2)


def test_distribution_percentiles():
    d = Distribution.of([float(v) for v in range(1, 101)])
    assert (d.count, d.mean, d.p50, d.max) == (100, 50.5, 50.5, 100.0)
    assert d.p90 == pytest.approx(90.1) and d.p99 == pytest.approx(99.01)
    assert math.isnan(Distribution.of([]).p50)


def test_distserve_goodput_reproduces_the_seed_table():
    # The seed's attainment table ("What disaggregation is for"), goodput at 90%.
    rates = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5]
    collocated_avg = [0.97, 0.75, 0.46, 0.23, 0.10, 0.05, 0.03]
    fast_pd_avg = [1.00, 0.99, 0.95, 0.88, 0.73, 0.41, 0.11]
    collocated_gap = [0.65, 0.29, 0.11, 0.05, 0.03, 0.02, 0.02]
    fast_pd_gap = [1.00, 0.99, 0.97, 0.92, 0.87, 0.76, 0.37]
    assert distserve_goodput(rates, collocated_avg, 0.9) == 0.2
    assert distserve_goodput(rates, fast_pd_avg, 0.9) == 0.6
    assert distserve_goodput(rates, collocated_gap, 0.9) == 0.0
    assert distserve_goodput(rates, fast_pd_gap, 0.9) == 0.8
    assert distserve_goodput(rates, collocated_gap, 0.6) == 0.2
    # Interpolated: where the line between two levels crosses 90%.
    assert interpolated_goodput(rates, collocated_avg, 0.9) == pytest.approx(0.2 + 0.2 * 0.07 / 0.22)
    assert interpolated_goodput(rates, fast_pd_avg, 0.9) == pytest.approx(0.6 + 0.2 * 0.05 / 0.07)
    assert interpolated_goodput(rates, collocated_gap, 0.9) == 0.0
    assert interpolated_goodput([1, 2], [0.95, 0.91], 0.9) == 2  # never extrapolated
    assert interpolated_goodput([1, math.inf], [0.95, 0.5], 0.9) == 1
    # non-monotone: the highest crossing counts
    assert interpolated_goodput([1, 2, 3, 4], [1.0, 0.8, 1.0, 0.8], 0.9) == pytest.approx(3.5)
