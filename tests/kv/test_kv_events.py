"""KV events: what an engine publishes (vLLM's KVEventBatch over ZMQ) matches its own
prefix cache, and a subscriber that joins late resyncs through the replay socket."""

from __future__ import annotations

import random
import time

import httpx
import msgpack

from splitserve.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    SequencedBatch,
    decode_batch,
    encode_batch,
)
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.router.kv_index import KVBlockIndex, KVEventFeed
from splitserve.runtime.kv_events import KVEventSubscriber
from tests.conftest import free_port, running_server, wait_until
from tests.generate_requests import generate_request

BLOCK = 4


def apply_events(held: set[bytes], batches: list[SequencedBatch]) -> set[bytes]:
    """The hashes a worker holds after the batches, as an indexer tracks them."""
    for _seq, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held -= set(event.block_hashes)
            else:
                held.clear()
    return held


def drain(subscriber: KVEventSubscriber, rounds: int = 5) -> list[SequencedBatch]:
    batches: list[SequencedBatch] = []
    for _ in range(rounds):
        batches.extend(subscriber.poll(100))
    return batches


def test_wire_shape_is_vllms_array_like_tagged_layout() -> None:
    stored = BlockStored([b"h1", b"h2"], None, list(range(8)), 4, None, "CPU")
    payload = encode_batch([stored, BlockRemoved([b"h0"], "CPU"), AllBlocksCleared()])
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank is None
    assert events == [
        ["BlockStored", [b"h1", b"h2"], None, list(range(8)), 4, None, "CPU"],
        ["BlockRemoved", [b"h0"], "CPU"],
        ["AllBlocksCleared"],
    ]
    assert decode_batch(payload).events == [stored, BlockRemoved([b"h0"], "CPU"), AllBlocksCleared()]


def test_events_match_the_engines_block_table_after_a_random_workload(tiny_model: str) -> None:
    port = free_port()
    events = KVEventsConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}")
    # few blocks: the workload evicts, so removals are exercised too
    config = EngineConfig(
        ModelConfig(tiny_model), CacheConfig(block_size=BLOCK, num_blocks=24), kv_events=events
    )
    engine = LLMEngine(config)
    subscriber = KVEventSubscriber(events.endpoint, events.replay_endpoint)
    try:
        rng = random.Random(7)
        prefixes = [[rng.randrange(10, 200) for _ in range(12)] for _ in range(3)]
        held: set[bytes] = set()
        for index in range(12):
            prompt = rng.choice(prefixes) + [rng.randrange(10, 200) for _ in range(rng.randrange(1, 10))]
            salt = "tenant-b" if index % 4 == 3 else None
            engine.add_request(
                generate_request(
                    f"r{index}", prompt, SamplingParams(max_tokens=5, temperature=0.0), cache_salt=salt
                )
            )
            while engine.has_unfinished_requests():
                engine.step()
            held = apply_events(held, drain(subscriber, rounds=2))
        # events arrive asynchronously (a publisher thread): drain until they settle
        deadline = time.monotonic() + 30
        while held != set(engine.block_manager.cached) and time.monotonic() < deadline:
            held = apply_events(held, subscriber.poll(100))
        assert held == set(engine.block_manager.cached)
        assert held, "the workload left cached blocks"
        # a stored event carries the tokens its hashes were computed from
        late = KVEventSubscriber(events.endpoint, events.replay_endpoint)
        replayed = late.replay(0)
        stored = [e for _s, b in replayed for e in b.events if isinstance(e, BlockStored)]
        first = stored[0]
        assert first.parent_block_hash is None
        assert first.block_hashes == compute_block_hashes(first.token_ids, BLOCK)
        assert any(isinstance(e, BlockRemoved) for _s, b in replayed for e in b.events)
        # a late subscriber rebuilds the same table from the replay socket alone
        assert apply_events(set(), replayed) == held
        assert [s for s, _b in replayed] == list(range(len(replayed)))
        late.close()
    finally:
        subscriber.close()
        engine.shutdown()


def test_engine_cli_publishes_and_a_late_subscriber_resyncs(tiny_model: str) -> None:
    port, events_port = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    args = [
        "engine",
        tiny_model,
        "--port",
        str(port),
        "--block-size",
        str(BLOCK),
        "--num-blocks",
        "64",
        "--kv-events-endpoint",
        endpoint,
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
    ]
    replay = args[-1]
    with running_server(args, port) as url:

        def generate(prompt: list[int]) -> None:
            body = {"token_ids": prompt, "sampling_params": {"max_tokens": 3, "temperature": 0}}
            assert httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60).status_code == 200

        first, second = list(range(20, 38)), list(range(60, 78))
        generate(first)
        # joins after the first request: its first live batch shows a gap, filled by replay
        late = KVEventSubscriber(endpoint, replay)
        try:
            batches: list[SequencedBatch] = []
            generate(second)
            # the live batches and the replay of the gap arrive in their own time: poll
            # until the second prompt's blocks are in (or give up and let the asserts say why)
            wanted = set(compute_block_hashes(second, BLOCK))
            for _ in range(50):
                batches.extend(late.poll(200))
                if batches and wanted <= apply_events(set(), batches):
                    break
                generate(second)
        finally:
            late.close()
    assert [seq for seq, _b in batches] == list(range(len(batches)))
    events = [e for _s, b in batches for e in b.events]
    assert events[0] == AllBlocksCleared()
    held = apply_events(set(), batches)
    assert set(compute_block_hashes(first, BLOCK)) <= held
    assert set(compute_block_hashes(second, BLOCK)) <= held


def run_prompt(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(generate_request(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0)))
    while engine.has_unfinished_requests():
        engine.step()


def test_router_index_follows_an_engine_through_a_restart(tiny_model: str) -> None:
    """The proxy's index (KVEventFeed): it joins after the engine cached blocks (replay),
    and when the engine restarts on the same endpoints it drops the old instance's blocks
    (AllBlocksCleared, numbers starting over) and indexes the new one's."""
    events = KVEventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    config = EngineConfig(
        ModelConfig(tiny_model), CacheConfig(block_size=BLOCK, num_blocks=32), kv_events=events
    )
    before, after = list(range(40, 58)), list(range(90, 108))
    index = KVBlockIndex()
    feed = KVEventFeed(index)
    engine = LLMEngine(config)
    try:
        run_prompt(engine, "a", before)
        feed.watch("w", events.endpoint, events.replay_endpoint)  # joins late
        assert wait_until(lambda: index.held("w") == set(engine.block_manager.cached))
        assert index.matched_blocks("w", compute_block_hashes(before, BLOCK)) == 4
        engine.shutdown()
        engine = LLMEngine(config)  # restarted: an empty cache, its events numbered from 0
        run_prompt(engine, "b", after)
        assert wait_until(lambda: index.held("w") == set(engine.block_manager.cached))
        assert index.matched_blocks("w", compute_block_hashes(before, BLOCK)) == 0
        assert index.matched_blocks("w", compute_block_hashes(after, BLOCK)) == 4
        # the worker leaves the pool: its subscription ends, the index holds nothing for it
        assert feed.unwatch("w") and feed.watching() == []
        assert index.held("w") == set() and "w" not in index.num_blocks()
        run_prompt(engine, "c", before)
        time.sleep(0.3)  # what it publishes now would land within a poll if still followed
        assert index.held("w") == set()
    finally:
        feed.close()
        engine.shutdown()


def test_malformed_replay_requests_do_not_stop_the_publisher() -> None:
    """Whoever reaches the replay port may send anything; the publisher drops what is not a
    replay request and goes on publishing and replaying."""
    import zmq

    from splitserve.runtime.kv_events import KVEventPublisher

    events = KVEventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = KVEventPublisher(events)
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    stranger.connect(events.replay_endpoint)
    try:
        publisher.publish([AllBlocksCleared()])
        for frames in ([b"hello"], [b"", b"x" * 20], [b"a", b"b", b"c", b"d"], [b"", b""]):
            stranger.send_multipart(frames)
        time.sleep(0.3)
        assert publisher.thread.is_alive()
        publisher.publish([BlockRemoved([b"h0"], "CPU")])
        time.sleep(0.2)  # queued batches go out on the publisher thread
        late = KVEventSubscriber(events.endpoint, events.replay_endpoint)
        replayed = late.replay(0)
        late.close()
        assert [s for s, _b in replayed] == [0, 1]
        assert not stranger.poll(100), "a malformed request gets no answer"
    finally:
        stranger.close(linger=0)
        context.term()
        publisher.shutdown()
