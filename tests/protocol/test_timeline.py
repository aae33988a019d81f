"""The request timeline's arithmetic (protocol/timeline.py): phases laid end to end never
sum to more than the interval they split, and an engine's phases are read from its chunk."""

from __future__ import annotations

import pytest

from splitserve.protocol.timeline import RequestTimeline, engine_phases, partition, wanted


def test_partition_clips_to_the_interval_and_leaves_the_rest_to_hops():
    parts = {"route": 0.001, "reserve": 0.02, "prefill": 0.05, "handoff": -0.003}
    split = partition(parts, 0.06)
    assert split == pytest.approx(
        {"route": 0.001, "reserve": 0.02, "prefill": 0.039, "handoff": 0.0, "hops": 0.0}
    )
    roomy = partition(parts, 0.1)
    assert roomy["hops"] == pytest.approx(0.029) and sum(roomy.values()) == pytest.approx(0.1)


def test_engine_phases_from_measured_phases_or_vllm_metrics():
    assert engine_phases({"metrics": {"phases": {"route": 0.002, "hops": 0.001}}}) == {
        "route": 0.002,
        "hops": 0.001,
    }
    vllm = engine_phases({"metrics": {"queue_time_ms": 3.0, "time_to_first_token_ms": 10.0}})
    assert vllm == pytest.approx({"prefill_queue": 0.003, "prefill": 0.007})
    assert engine_phases({"choices": []}) is None


def test_timeline_splits_the_first_chunk_wait_and_reports_once():
    seen: list[dict] = []

    class Sink:
        def observe_phases(self, phases):
            seen.append(dict(phases))

        def observe_derender_call(self, seconds):
            seen.append({"call": seconds})

    timeline = RequestTimeline(Sink())
    timeline.add("render", 0.004)
    timeline.first_chunk(0.03)
    timeline.engine({"prefill_queue": 0.001, "prefill": 0.02})
    timeline.derender_call(0.002)
    phases = timeline.finish()
    assert phases == pytest.approx(
        {"render": 0.004, "prefill_queue": 0.001, "prefill": 0.02, "hops": 0.009, "derender": 0.002}
    )
    assert list(phases) == ["render", "prefill_queue", "prefill", "hops", "derender"]  # request order
    timeline.finish()
    assert seen == [{"call": 0.002}, phases]  # the sink saw the request once
    assert wanted("1") and wanted("true") and not wanted(None) and not wanted("0")
