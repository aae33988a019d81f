"""The engine's KV event publisher: ZMQ PUB plus a replay socket (vLLM's ZmqEventPublisher).

The engine thread only queues batches; one publisher thread owns both sockets (ZMQ sockets
are not thread-safe), numbers the batches, keeps the last `buffer_steps` for replay and
answers replay requests. Wire shapes live in `protocol/kv_events.py`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from splitserve.config import KVEventsConfig
from splitserve.protocol.kv_events import END_OF_REPLAY, KVCacheEvent, decode_seq, encode_batch, encode_seq

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
