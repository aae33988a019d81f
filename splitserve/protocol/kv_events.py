"""KV cache events on the wire: vLLM's `KVEventBatch` shape, msgpack over ZMQ (torch-free).

An engine publishes what enters and leaves its prefix cache so an indexer (the proxy's
router, or one built for vLLM such as llm-d's) knows which worker holds which block hash.
The layout is vLLM's msgspec `array_like` + `tag=True` encoding, so both sides agree:

- batch: `[ts, [event, ...], data_parallel_rank]`
- `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
- `["BlockRemoved", block_hashes, medium]`
- `["AllBlocksCleared"]`

Transport (vLLM's `ZmqEventPublisher`): PUB sends multipart `[topic, seq, payload]`, seq an
8-byte big-endian counter; a ROUTER replay socket answers a DEALER's `[b"", start_seq]`
with every buffered `[b"", seq, payload]` from start_seq on, then `[b"", -1, b""]`.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgpack
import zmq

END_OF_REPLAY = -1


class BlockStored(NamedTuple):
    """Consecutive blocks of one sequence entered the cache; `token_ids` covers them all."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(NamedTuple):
    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(NamedTuple):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(NamedTuple):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class SequencedBatch(NamedTuple):
    seq: int
    batch: KVEventBatch


_EVENT_TYPES: dict[str, type] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def encode_batch(events: list[KVCacheEvent], data_parallel_rank: int | None = None) -> bytes:
    wire_events = [[type(event).__name__, *event] for event in events]
    return msgpack.packb([time.time(), wire_events, data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes; ValueError for an unknown event tag."""
    ts, wire_events, *rest = msgpack.unpackb(payload, raw=False)
    events: list[KVCacheEvent] = []
    for tag, *fields in wire_events:
        event_type = _EVENT_TYPES.get(tag)
        if event_type is None:
            raise ValueError(f"unknown KV event type {tag!r}")
        events.append(event_type(*fields))
    return KVEventBatch(ts, events, rest[0] if rest else None)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def connect_address(endpoint: str, host: str = "127.0.0.1") -> str:
    """The address a subscriber connects to for a publisher's bind endpoint (`*` → host)."""
    return endpoint.replace("*", host)


def replay_endpoint_for(endpoint: str) -> str:
    """The default replay endpoint: the events endpoint's port + 1 (tcp://host:port)."""
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"KV events endpoint {endpoint!r} has no port; name a replay endpoint")
    return f"{base}:{int(port) + 1}"


class KVEventSubscriber:
    """Receives one publisher's batches in order. A subscriber that joins late or misses
    messages (a sequence gap) fetches what it lacks from the replay socket first, so the
    batches it returns run without gaps from the oldest one the publisher still buffers."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.last_seq = -1  # the last batch returned, live or replayed
        # payloads of the last replay, until the live stream passes them: a live batch with
        # one of their numbers is either the same batch again or from a restarted publisher
        self.replayed: dict[int, bytes] = {}
        # batch 0 of the publisher instance followed (its AllBlocksCleared, with its time):
        # a different batch 0 in the replay buffer means the publisher restarted
        self.first_payload: bytes | None = None

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
                self.last_seq = -1
            self.replayed.clear()
            if seq > self.last_seq + 1 and self.replay_endpoint is not None:
                received.extend(self.replay(self.last_seq + 1, seq))
            received.append(SequencedBatch(seq, decode_batch(payload)))
            if seq == 0:
                self.first_payload = payload
            self.last_seq = seq
        return received

    def publisher_restarted(self) -> bool:
        """Whether the publisher's batch 0 is not the one this subscriber followed (a
        restart whose live batches were all missed); False when batch 0 is gone."""
        if self.first_payload is None or self.replay_endpoint is None:
            return False
        first = self._fetch(0, 1)
        return bool(first) and first[0][1] != self.first_payload

    def resync(self) -> list[SequencedBatch]:
        """Every buffered batch from 0, as after a restart."""
        self.last_seq, self.first_payload = -1, None
        self.replayed.clear()
        return self.replay(0)

    def replay(
        self, start_seq: int, stop_seq: int | None = None, timeout_ms: int = 2000
    ) -> list[SequencedBatch]:
        """Batches start_seq ≤ seq < stop_seq (all buffered ones when None) from the replay
        socket; advances `last_seq`."""
        batches: list[SequencedBatch] = []
        for seq, payload in self._fetch(start_seq, stop_seq, timeout_ms):
            batches.append(SequencedBatch(seq, decode_batch(payload)))
            self.replayed[seq] = payload
            if seq == 0:
                self.first_payload = payload
            self.last_seq = max(self.last_seq, seq)
        return batches

    def _fetch(self, start_seq: int, stop_seq: int | None, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
        assert self.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        found: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart([b"", encode_seq(start_seq)])
            while dealer.poll(timeout_ms):
                _empty, seq_frame, payload = dealer.recv_multipart()
                seq = decode_seq(seq_frame)
                if seq == END_OF_REPLAY:
                    break
                if stop_seq is None or seq < stop_seq:
                    found.append((seq, payload))
        finally:
            dealer.close()
        return found

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()
