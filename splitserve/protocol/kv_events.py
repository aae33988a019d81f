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


RESET_SEQ = -1  # a batch the subscriber made up: everything known of the publisher is void


def reset_batch() -> SequencedBatch:
    """What a subscriber returns when it lost track (a restart, or a gap it cannot fill):
    applied in order like any batch, it drops the worker's blocks, so an index never keeps
    a block the engine may have removed in the batches it missed."""
    return SequencedBatch(RESET_SEQ, KVEventBatch(time.time(), [AllBlocksCleared()]))


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
