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
with every buffered `[b"", seq, payload]` from start_seq on, then `[b"", -1, b""]`. The
sockets at both ends, the engine's publisher and the router's subscriber, are
`runtime/kv_events.py`.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgpack

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
