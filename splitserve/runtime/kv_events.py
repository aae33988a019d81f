"""The sockets of KV cache events: the engine's publisher and the router's subscriber
(ZMQ; the wire shapes live in `protocol/kv_events.py`).

Publisher: ZMQ PUB plus a replay socket (vLLM's ZmqEventPublisher). The engine thread only
queues batches; one publisher thread owns both sockets (ZMQ sockets are not thread-safe),
numbers the batches, keeps the last `buffer_steps` for replay and answers replay requests.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from splitserve.config import KVEventsConfig
from splitserve.protocol.kv_events import (
    END_OF_REPLAY,
    KVCacheEvent,
    SequencedBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    reset_batch,
)

logger = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.pending: queue.Queue[list[KVCacheEvent] | None] = queue.Queue()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind(config.endpoint)
        self.replay = self.context.socket(zmq.ROUTER)
        # A ROUTER drops what it sends past a peer's high-water mark (1,000 by default):
        # a replay of a longer buffer lost its tail and its end marker, and the subscriber
        # took the rest for the whole. One whole buffer fits per peer.
        self.replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
        self.replay.bind(config.replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (non-blocking; called from the engine thread)."""
        if events:
            self.pending.put(events)

    def shutdown(self) -> None:
        self.pending.put(None)
        self.thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while True:
                # send what is queued first, so a replay covers every batch queued before it
                while True:
                    try:
                        events = self.pending.get_nowait()
                    except queue.Empty:
                        break
                    if events is None:
                        return
                    self._send(events)
                if self.replay.poll(20):
                    self._answer_replay()
        except Exception:
            logger.exception("KV event publisher stopped")
        finally:
            self.pub.close(linger=0)
            self.replay.close(linger=0)
            self.context.term()

    def _send(self, events: list[KVCacheEvent]) -> None:
        payload = encode_batch(events, self.data_parallel_rank)
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        self.pub.send_multipart([self.config.topic.encode(), encode_seq(seq), payload])

    def _answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        # Anyone who reaches the port may send anything: a malformed request is dropped,
        # never allowed to stop the publisher (and with it the engine's events).
        if len(frames) != 3 or frames[1] != b"" or not 1 <= len(frames[2]) <= 8:
            logger.warning("dropped a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _empty, start_frame = frames
        start_seq = decode_seq(start_frame)
        for seq, payload in self.buffer:
            if seq >= start_seq:
                self.replay.send_multipart([client, b"", encode_seq(seq), payload])
        self.replay.send_multipart([client, b"", encode_seq(END_OF_REPLAY), b""])


class KVEventSubscriber:
    """Receives one publisher's batches in order. A subscriber that joins late or misses
    messages (a sequence gap) fetches what it lacks from the replay socket first, checking
    that the publisher is still the one it followed (its batch `last_seq` unchanged); a
    restarted publisher is followed from its oldest buffered batch, after a reset batch;
    a gap the replay cannot fill whole (no replay socket, batches no longer buffered, an
    answer cut short) gives a reset batch too, so applying the batches in order never
    leaves a block the engine removed."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.last_seq = -1  # the last batch returned, live or replayed
        self.last_payload: bytes | None = None  # its payload: who published it
        # payloads of the last replay, until the live stream passes them: a live batch with
        # one of their numbers is either the same batch again or from a restarted publisher
        self.replayed: dict[int, bytes] = {}
        self.started = False  # returned a batch: its consumer holds something to reset

    def poll(self, timeout_ms: int = 100) -> list[SequencedBatch]:
        """The batches that arrived within `timeout_ms`, replayed gaps included."""
        received: list[SequencedBatch] = []
        if not self.sub.poll(timeout_ms):
            return received
        while self.sub.poll(0):
            _topic, seq_frame, payload = self.sub.recv_multipart()
            seq = decode_seq(seq_frame)
            if seq <= self.last_seq:
                if self.replayed.get(seq) == payload:
                    continue  # already replayed
                # an unseen batch with an old number: the publisher restarted, counting from 0
                received.extend(self._resync(seq))
            elif seq > self.last_seq + 1:
                received.extend(self._fill(seq))
            self.replayed.clear()
            received.append(self._take(seq, payload))
        return received

    def sync(self) -> list[SequencedBatch]:
        """What was published since `last_seq` and not received live (checked as a gap
        is); nothing when the replay socket does not answer (the publisher may be down)."""
        if self.replay_endpoint is None:
            return []
        if self.last_seq < 0:
            return self._resync(None)
        run = self._fetch_run(self.last_seq, None)
        if run is None:
            return []
        return self._continue(run, None)

    def _fill(self, stop: int) -> list[SequencedBatch]:
        """The missed batches last_seq+1 .. stop-1, or a reset when they cannot all be had."""
        if self.replay_endpoint is None:
            return [self._reset()] if self.started else []
        if self.last_seq < 0:
            return self._resync(stop)
        run = self._fetch_run(self.last_seq, stop)
        if run is None:
            return [self._reset()] if self.started else []
        return self._continue(run, stop)

    def _continue(self, run: list[tuple[int, bytes]], stop: int | None) -> list[SequencedBatch]:
        if not run or run[0] != (self.last_seq, self.last_payload):
            return self._resync(stop)  # batch last_seq is gone or another: a restarted publisher
        return [self._take(seq, payload, replayed=True) for seq, payload in run[1:]]

    def _resync(self, stop: int | None) -> list[SequencedBatch]:
        """A reset, then the publisher's batches from its oldest buffered one (before
        `stop`), when the replay socket has them all."""
        batches = [self._reset()] if self.started else []
        run = self._fetch_run(0, stop) if self.replay_endpoint is not None else None
        if run is not None:
            batches += [self._take(seq, payload, replayed=True) for seq, payload in run]
        return batches

    def _reset(self) -> SequencedBatch:
        self.last_seq, self.last_payload = -1, None
        return reset_batch()

    def _take(self, seq: int, payload: bytes, replayed: bool = False) -> SequencedBatch:
        if replayed:
            self.replayed[seq] = payload
        self.last_seq, self.last_payload, self.started = seq, payload, True
        return SequencedBatch(seq, decode_batch(payload))

    def replay(
        self, start_seq: int, stop_seq: int | None = None, timeout_ms: int = 2000
    ) -> list[SequencedBatch]:
        """Batches start_seq <= seq < stop_seq (all buffered ones when None) from the replay
        socket, as they come; advances `last_seq`."""
        found, _complete = self._fetch(start_seq, stop_seq, timeout_ms)
        return [self._take(seq, payload, replayed=True) for seq, payload in found]

    def _fetch_run(self, start: int, stop: int | None) -> list[tuple[int, bytes]] | None:
        """The publisher's consecutive batches from the first it buffers at or after
        `start` through `stop - 1` (through its newest when None), in as many replays as a
        publisher that cuts answers short needs; None when it stops answering or the run
        has a hole or ends early."""
        run: list[tuple[int, bytes]] = []
        while True:
            next_seq = run[-1][0] + 1 if run else start
            if stop is not None and next_seq >= stop and run:
                return run
            found, complete = self._fetch(next_seq, stop)
            for seq, payload in found:
                if run and seq != run[-1][0] + 1:
                    return None
                run.append((seq, payload))
            if complete:
                reached = stop is None or (run and run[-1][0] == stop - 1) or (not run and start >= stop)
                return run if reached else None
            if not found:
                return None

    def _fetch(
        self, start_seq: int, stop_seq: int | None, timeout_ms: int = 2000
    ) -> tuple[list[tuple[int, bytes]], bool]:
        """One replay: the batches it brought, and whether its end marker came."""
        assert self.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a whole buffer's answer, however long
        dealer.connect(self.replay_endpoint)
        found: list[tuple[int, bytes]] = []
        complete = False
        try:
            dealer.send_multipart([b"", encode_seq(start_seq)])
            while dealer.poll(timeout_ms):
                _empty, seq_frame, payload = dealer.recv_multipart()
                seq = decode_seq(seq_frame)
                if seq == END_OF_REPLAY:
                    complete = True
                    break
                if stop_seq is None or seq < stop_seq:
                    found.append((seq, payload))
        finally:
            dealer.close()
        return found, complete

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()
