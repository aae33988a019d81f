"""The client and load generator against a real local HTTP server with controlled timing
and faults (tests/bench/fake_openai_server.py)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.bench.client import ClientConfig, SSEParser, StreamingClient, chunk_output
from splitserve.bench.load import LoadSpec
from splitserve.bench.metrics import summarize
from splitserve.bench.runner import BenchPlan, run_benchmark
from splitserve.bench.workload import PromptFactory, SessionFactory, SyntheticSpec, Tokenizer
from splitserve.goodput import SLO, Lengths
from tests.bench.conftest import fake_server, reset_stats, server_stats
from tests.conftest import free_port

SLOS = (SLO.parse("ttft=2s,tpot=30ms"), SLO.parse("ttft=2s,gap=100ms"))


@pytest.fixture(scope="module")
def prompts(tiny_model) -> PromptFactory:
    return PromptFactory(Tokenizer(tiny_model), seed=0)


def bench(url, prompts, loads, output_len="8:16", turns=1, endpoint="chat", timeout=30.0, slos=SLOS):
    spec = SyntheticSpec(Lengths.parse("16:32"), Lengths.parse(output_len), turns=turns)
    client = ClientConfig(url, "fake-model", endpoint=endpoint, timeout=timeout)
    plan = BenchPlan(client, tuple(loads), slos)
    return run_benchmark(plan, SessionFactory(prompts, spec, seed=0), settings={}, count_tokens=prompts.count)


def check_consistent(level, expected_requests, slos=SLOS):
    records, summary = level.records, level.summary
    measured = [r for r in records if not r.warmup]
    assert len(measured) == summary.requests == expected_requests
    assert summary.completed + summary.failed == summary.requests
    assert sorted(r.request_id for r in records) == list(range(len(records)))
    for r in records:
        if r.ok:
            assert 0 < r.ttft < r.e2e
            assert sum(r.gaps) == pytest.approx(r.e2e - r.ttft, abs=1e-9)
            assert len(r.chunk_times) == r.output_tokens  # one token per chunk from this server
    assert summary == summarize(records, slos, level.load.rate, level.load.concurrency)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_short_poisson_run_is_counted_and_consistent(steady_server, prompts, endpoint):
    reset_stats(steady_server)
    result = bench(steady_server, prompts, [LoadSpec(rate=40, num_requests=12, warmup=2)], endpoint=endpoint)
    (level,) = result.levels
    check_consistent(level, 12)
    assert server_stats(steady_server)["requests"] == 14  # warm-up requests were sent too
    assert level.summary.failed == 0
    records = [r for r in level.records if not r.warmup]
    assert all(8 <= r.output_tokens <= 16 for r in records)
    assert all(r.ttft >= 0.02 for r in records)  # the server waits 20 ms before the first token
    lenient = SLO.parse("ttft=2s,tpot=500ms,gap=1s")  # far above this server's timing
    assert summarize(level.records, [lenient], rate=40).attainment == {lenient.name: 1.0}


def test_sweep_levels_are_each_consistent(steady_server, prompts):
    loads = [LoadSpec(rate=rate, num_requests=8, warmup=1, seed=i) for i, rate in enumerate((10.0, 50.0))]
    # Targets far above this server's 20 ms TTFT and 2 ms gaps: a busy machine cannot miss them.
    lenient = (SLO.parse("ttft=2s"), SLO.parse("ttft=2s,gap=1s"))
    result = bench(steady_server, prompts, loads, slos=lenient)
    assert [level.load.rate for level in result.levels] == [10.0, 50.0]
    for level in result.levels:
        check_consistent(level, 8, lenient)
    # 8 Poisson arrivals at 10/s take about 0.7 s; at 50/s about 0.15 s.
    assert result.levels[0].summary.duration > result.levels[1].summary.duration
    assert result.distserve_goodput == {slo.name: 50.0 for slo in lenient}


def test_usage_missing_counts_tokens_from_text(prompts):
    with fake_server("--no-usage") as url:
        (level,) = bench(url, prompts, [LoadSpec(rate=100, num_requests=4)], output_len="6").levels
    # The streamed text, "tok " x 6, counted with the model's tokenizer (not the 6 chunks).
    assert [r.output_tokens for r in level.records] == [prompts.count("tok " * 6)] * 4


def test_errors_are_counted_and_the_run_continues(prompts):
    with fake_server("--fail-every", "4", "--garbage-every", "5", "--hang-every", "7") as url:
        result = bench(url, prompts, [LoadSpec(rate=200, num_requests=20)], timeout=0.5)
    (level,) = result.levels
    check_consistent(level, 20)
    # Server request numbers start at 1: 4, 8, 12, 16, 20 fail; 5, 10, 15 garble; 7, 14 hang.
    assert level.summary.errors == {"HTTP 500": 5, "bad stream": 3, "timeout": 2}
    assert level.summary.completed == 10
    lenient = SLO.parse("e2e=10s")  # failed requests are misses, every other one meets it
    assert summarize(level.records, [lenient], rate=200).attainment[lenient.name] == pytest.approx(0.5)


def test_refused_connection_is_an_error_not_a_crash(prompts):
    url = f"http://127.0.0.1:{free_port()}"
    (level,) = bench(url, prompts, [LoadSpec(rate=100, num_requests=3)]).levels
    assert level.summary.failed == 3 and level.summary.errors == {"connect": 3}


def test_stalls_show_in_worst_gap_not_in_averages(prompts):
    with fake_server("--itl", "0.002", "--stall-every", "3", "--stall", "0.5") as url:
        (level,) = bench(url, prompts, [LoadSpec(rate=50, num_requests=9)], output_len="40").levels
    # a chunk read late before the stall shortens the gap the client sees: hence 0.3, not 0.5
    stalled = [r for r in level.records if r.worst_gap >= 0.3]
    assert len(stalled) == 3  # the server's requests 3, 6 and 9
    # Thresholds far from 2 ms and 500 ms, so a busy test machine cannot flip them.
    avg, gap = SLO.parse("ttft=2s,tpot=30ms"), SLO.parse("ttft=2s,gap=300ms")
    summary = summarize(level.records, [avg, gap], rate=50)
    assert summary.attainment[gap.name] == pytest.approx(6 / 9)
    # A 500 ms stall over 40 tokens adds only ~13 ms of TPOT: the average target passes them.
    assert all(r.tpot < 0.03 for r in stalled) and summary.attainment[avg.name] == 1.0


def test_concurrency_cap_and_closed_loop(steady_server, prompts):
    reset_stats(steady_server)
    (level,) = bench(
        steady_server, prompts, [LoadSpec(rate=float("inf"), concurrency=3, num_requests=12)]
    ).levels
    assert server_stats(steady_server)["max_in_flight"] == 3
    check_consistent(level, 12)


def test_duration_bounds_the_run(steady_server, prompts):
    load = LoadSpec(rate=20, num_requests=None, duration=0.5)
    (level,) = bench(steady_server, prompts, [load]).levels
    assert all(r.start < 0.55 for r in level.records)
    assert 3 <= level.summary.requests <= 25


def test_multi_turn_resends_the_conversation(steady_server, prompts):
    reset_stats(steady_server)
    load = LoadSpec(rate=100, num_requests=6)
    (level,) = bench(steady_server, prompts, [load], output_len="5", turns=3).levels
    seen = server_stats(steady_server)["seen"]
    check_consistent(level, 6)
    assert sorted(len(s["roles"]) for s in seen) == [1, 1, 3, 3, 5, 5]
    third = next(s["body"]["messages"] for s in seen if len(s["roles"]) == 5)
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == "tok " * 5  # the real answer of the previous turn
    # The client's input count grows by each turn's prompt and answer.
    by_session = sorted((r.session, r.turn, r.input_tokens) for r in level.records)
    assert by_session[0][2] < by_session[1][2] < by_session[2][2]


def test_sse_parser_and_chunk_shapes():
    parser = SSEParser()
    assert parser.feed(b'data: {"a": 1}\n\ndata: [DO') == ['{"a": 1}']
    assert parser.feed(b"NE]\r\n\r\n: comment\n\n") == ["[DONE]"]
    # A UTF-8 character split across two reads, then a multi-line event.
    cafe = "data: caf\u00e9".encode()
    assert parser.feed(cafe[:-1]) == []
    assert parser.feed(cafe[-1:] + b"\n\nevent: x\ndata: a\ndata: b\n\n") == ["caf\u00e9", "a\nb"]
    assert chunk_output({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ("", False)
    assert chunk_output({"choices": [{"delta": {"reasoning_content": "hmm"}}]}) == ("", True)
    assert chunk_output({"choices": [{"index": 0, "text": "hi"}]}) == ("hi", True)
    assert chunk_output({"choices": [], "usage": {"completion_tokens": 3}}) == ("", False)


def test_client_send_returns_a_record_for_every_outcome(steady_server):
    async def go():
        config = ClientConfig(steady_server, "fake-model", timeout=10)
        async with StreamingClient(config) as client:
            good = await client.send([{"role": "user", "content": "a b c"}], 5, 3, 0.0, request_id=0)
        return good

    reply = asyncio.run(go())
    assert reply.text == "tok " * 5 and reply.record.ok
    assert reply.record.input_tokens == 3 and reply.record.output_tokens == 5
