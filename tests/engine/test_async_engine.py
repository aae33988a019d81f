"""AsyncEngine: concurrent generates, aborts, early close, bad input, step failures."""

from __future__ import annotations

import asyncio
import threading

import pytest

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.llm import LLM
from splitserve.protocol.errors import InvalidRequestError, PromptTooLongError
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts
from tests.generate_requests import generate_request

PROMPTS = make_prompts(2048, seed=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def config(model_dir: str, num_blocks: int = 48, **scheduler) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model_dir),
        CacheConfig(num_blocks=num_blocks),
        SchedulerConfig(max_model_len=256, **scheduler),
    )


@pytest.fixture(scope="module")
def engine(tiny_model):
    with AsyncEngine(config(tiny_model)) as running:
        yield running


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY):
    tokens, last = [], None
    async for out in engine.generate(generate_request(request_id, prompt, params)):
        tokens.extend(out.new_token_ids)
        last = out
    return tokens, last


async def collect_signalling(engine: AsyncEngine, request_id: str, prompt: list[int], params, started):
    tokens, last = [], None
    async for out in engine.generate(generate_request(request_id, prompt, params)):
        tokens.extend(out.new_token_ids)
        last = out
        started.set()
    return tokens, last


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if (
            stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_blocks_free == stats.num_blocks_total
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


def test_concurrent_generates_equal_offline(engine, tiny_model):
    expected = [r.token_ids for r in LLM(tiny_model, num_blocks=48).generate(PROMPTS, GREEDY)]
    steps: list[tuple[float, int]] = []
    engine.add_step_listener(lambda t, n: steps.append((t, n)))

    async def main():
        return await asyncio.gather(*(collect(engine, f"c{i}", p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    for (_, last), prompt in zip(results, PROMPTS, strict=True):
        assert last.finished and last.finish_reason == "length"
        assert last.num_prompt_tokens == len(prompt)
        m = last.metrics
        assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"]
        assert m["first_token_time"] <= m["last_token_time"] <= m["finished_time"]
    assert steps and all(t > 0 and n > 0 for t, n in steps)
    assert max(n for _, n in steps) > len(PROMPTS)  # prefills were batched into one step


def test_abort_and_early_close_free_blocks(engine):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        # early close: the client stops reading after two outputs
        stream = engine.generate(generate_request("closed", PROMPTS[2], long))
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        assert not got[-1].finished
        # the ID is free again at once (the abort is applied before the new request)
        tokens, last = await collect(engine, "closed", PROMPTS[0])
        assert len(tokens) == 10 and last.finish_reason == "length"
        # explicit abort while another client reads
        started = asyncio.Event()
        reader = asyncio.create_task(collect_signalling(engine, "aborted", PROMPTS[1], long, started))
        await started.wait()
        assert engine.abort("aborted")
        tokens, last = await reader
        assert last.finished and last.finish_reason == "abort" and len(tokens) < 200
        assert not engine.abort("no-such-request")
        # cancellation (client disconnect in a server) also aborts
        started = asyncio.Event()
        task = asyncio.create_task(collect_signalling(engine, "cancelled", PROMPTS[3], long, started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        # the engine still serves
        tokens, last = await collect(engine, "after", PROMPTS[0])
        assert len(tokens) == 10

    asyncio.run(main())


@pytest.mark.parametrize(
    ("prompt", "error", "param"),
    [
        ([], InvalidRequestError, "token_ids"),
        ([1, -1], InvalidRequestError, "token_ids"),
        ([1, 2048], InvalidRequestError, "token_ids"),
        ([1, True], InvalidRequestError, "token_ids"),
        ([5] * 256, PromptTooLongError, "token_ids"),
    ],
)
def test_bad_prompts_raise_before_any_output(engine, prompt, error, param):
    async def main():
        with pytest.raises(error) as info:
            async for _ in engine.generate(generate_request("bad", prompt, GREEDY)):
                raise AssertionError("no output expected")
        assert info.value.param == param

    asyncio.run(main())


def test_duplicate_request_id_and_kv_budget(engine, tiny_model):
    async def main():
        first = engine.generate(
            generate_request("dup", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0))
        )
        await first.__anext__()
        with pytest.raises(InvalidRequestError):
            await engine.generate(generate_request("dup", PROMPTS[0], GREEDY)).__anext__()
        await first.aclose()

    asyncio.run(main())
    with AsyncEngine(config(tiny_model, num_blocks=2)) as small:
        # 2 blocks of 16 hold at most a 31-token prompt (plus one generated token)

        async def too_big():
            with pytest.raises(PromptTooLongError):
                await small.generate(generate_request("x", [5] * 32, GREEDY)).__anext__()
            tokens, last = await collect(small, "ok", [5] * 31, SamplingParams(max_tokens=5, temperature=0))
            # positions 0..31 fit; the token sampled at position 31 is the last one
            assert len(tokens) == 2 and last.finish_reason == "length"

        asyncio.run(too_big())


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(tiny_model):
    with AsyncEngine(config(tiny_model)) as engine:
        runner = engine.engine.runner
        real_execute = runner.execute
        failures = threading.Event()

        def flaky(scheduled):
            if not failures.is_set():
                failures.set()
                raise RuntimeError("injected failure")
            return real_execute(scheduled)

        runner.execute = flaky

        async def main():
            _, last = await collect(engine, "victim", PROMPTS[0])
            assert last.finish_reason == "error"
            tokens, last = await collect(engine, "survivor", PROMPTS[0])
            assert last.finish_reason == "length" and len(tokens) == 10
            await wait_idle(engine)

        asyncio.run(main())
        engine.engine.check_integrity()


def test_generate_requires_start(tiny_model):
    engine = AsyncEngine(config(tiny_model))

    async def main():
        with pytest.raises(RuntimeError):
            await engine.generate(generate_request("x", [1, 2], GREEDY)).__anext__()

    asyncio.run(main())
