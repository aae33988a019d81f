"""KV-event conformance: whatever happens to the stream (sequence gaps, a publisher
restarted with its numbers reset, AllBlocksCleared, replays longer than ZeroMQ's
high-water mark), applying what the subscriber returns leaves the proxy's index
(`KVBlockIndex`) equal to the publisher's own record of what it stored and removed, or,
where batches are lost for good, without any block the publisher removed. Real
publishers (runtime/kv_events.py) on real sockets; a lost live batch is one published while the
subscriber's SUB socket is disconnected."""

from __future__ import annotations

import time

from splitserve.config import KVEventsConfig
from splitserve.runtime.kv_events import KVEventPublisher
from splitserve.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSubscriber
from splitserve.router.kv_index import KVBlockIndex, KVEventFeed
from tests.conftest import free_port
from tests.kv.test_kv_events import wait_until

WORKER = "w"


class RecordingPublisher:
    """A real publisher and its own record of the blocks it holds (the engine's table)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.publisher = KVEventPublisher(config)
        self.held: set[bytes] = set()
        self.publisher.publish([AllBlocksCleared()])  # as an engine starts

    def store(self, *hashes: bytes) -> None:
        self.held |= set(hashes)
        self.publisher.publish([BlockStored(list(hashes), None, [1] * 4 * len(hashes), 4)])

    def remove(self, *hashes: bytes) -> None:
        self.held -= set(hashes)
        self.publisher.publish([BlockRemoved(list(hashes))])

    def clear(self) -> None:
        self.held.clear()
        self.publisher.publish([AllBlocksCleared()])

    def published(self) -> int:
        return self.publisher.next_seq

    def close(self) -> None:
        self.publisher.shutdown()


def _config(buffer_steps: int = 10_000) -> KVEventsConfig:
    return KVEventsConfig(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", buffer_steps=buffer_steps
    )


def _follow_until(subscriber: KVEventSubscriber, index: KVBlockIndex, publisher: RecordingPublisher, probe):
    """Poll and apply until a probe (a store `probe()` publishes, one more each round)
    is indexed: a fresh SUB connection misses what is published before it settles, and
    the batches before the probe are then in (live or replayed)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        probed = probe()
        for _ in range(3):
            for _seq, batch in subscriber.poll(100):
                index.apply(WORKER, batch)
            if probed in index.held(WORKER):
                return
    raise AssertionError("no probe arrived")


def _probe(publisher: RecordingPublisher, counter) -> bytes:
    block = b"probe-%d" % next(counter)
    publisher.store(block)
    return block


def _lose_live(subscriber: KVEventSubscriber, config: KVEventsConfig, publish) -> None:
    """`publish()` while the subscriber's SUB socket is disconnected: those batches are lost live."""
    subscriber.sub.disconnect(config.endpoint)
    publish()
    time.sleep(0.2)  # the publisher thread sends what was queued to nobody
    subscriber.sub.connect(config.endpoint)


def test_a_gap_is_filled_from_the_replay_and_one_it_cannot_fill_drops_the_workers_blocks():
    config = _config(buffer_steps=50)
    publisher = RecordingPublisher(config)
    subscriber = KVEventSubscriber(config.endpoint, config.replay_endpoint)
    index = KVBlockIndex()
    counter = iter(range(10_000))
    try:
        for _seq, batch in subscriber.sync():
            index.apply(WORKER, batch)
        publisher.store(b"a", b"b")
        _follow_until(subscriber, index, publisher, lambda: _probe(publisher, counter))
        assert index.held(WORKER) == publisher.held

        # missed: a removal and a store, still buffered: fetched from the replay socket
        _lose_live(subscriber, config, lambda: (publisher.remove(b"a"), publisher.store(b"c")))
        _follow_until(subscriber, index, publisher, lambda: _probe(publisher, counter))
        assert index.held(WORKER) == publisher.held

        # missed: a removal that the 50-batch buffer no longer has: the worker's blocks go
        # rather than keep "b", which the engine removed
        def lost() -> None:
            publisher.remove(b"b")
            for n in range(60):
                publisher.store(b"q%d" % n)

        _lose_live(subscriber, config, lost)
        _follow_until(subscriber, index, publisher, lambda: _probe(publisher, counter))
        held = index.held(WORKER)
        assert b"b" not in held and held <= publisher.held
        assert b"q59" in held  # what the buffer still had is indexed
    finally:
        subscriber.close()
        publisher.close()


def test_a_restarted_publisher_whose_numbers_passed_the_old_ones_is_followed_afresh():
    """The engine restarts on the same endpoints and publishes more batches than the old
    instance had before the subscriber sees one: the gap's replay comes from the new
    instance, whose batch `last_seq` is another, so the old blocks go and the new
    instance is followed from its batch 0."""
    config = _config()
    old = RecordingPublisher(config)
    subscriber = KVEventSubscriber(config.endpoint, config.replay_endpoint)
    index = KVBlockIndex()
    counter = iter(range(10_000))
    try:
        old.store(b"old-1", b"old-2")
        _follow_until(subscriber, index, old, lambda: _probe(old, counter))
        assert index.held(WORKER) == old.held
        last_seq = subscriber.last_seq
        new: list[RecordingPublisher] = []

        def restart() -> None:
            old.close()
            new.append(RecordingPublisher(config))
            for n in range(last_seq + 3):  # past the old instance's numbers
                new[0].store(b"new-%d" % n)

        _lose_live(subscriber, config, restart)
        restarted = new[0]
        try:
            _follow_until(subscriber, index, restarted, lambda: _probe(restarted, counter))
            assert subscriber.last_seq > last_seq + 1
            assert index.held(WORKER) == restarted.held
        finally:
            restarted.close()
    finally:
        subscriber.close()


def test_the_feed_follows_clears_restarts_and_replays_longer_than_the_high_water_mark():
    """The proxy's feed joins a publisher that buffers 4,000 batches (a replay past
    ZeroMQ's default high-water mark of 1,000, past which a ROUTER drops what it sends),
    follows an AllBlocksCleared, and a restart numbered from 0 again."""
    config = _config()
    publisher = RecordingPublisher(config)
    index = KVBlockIndex()
    feed = KVEventFeed(index)
    try:
        for n in range(3000):
            publisher.store(b"h%d" % n)
            if n % 3 == 0:
                publisher.remove(b"h%d" % (n // 2))
        assert wait_until(lambda: publisher.published() > 4000)
        feed.watch(WORKER, config.endpoint, config.replay_endpoint)
        assert wait_until(lambda: index.held(WORKER) == publisher.held)
        publisher.clear()
        publisher.store(b"after-clear")
        assert wait_until(lambda: index.held(WORKER) == publisher.held == {b"after-clear"})
        publisher.close()
        publisher = RecordingPublisher(config)
        publisher.store(b"restarted")
        assert wait_until(lambda: index.held(WORKER) == publisher.held == {b"restarted"})
    finally:
        feed.close()
        publisher.close()
