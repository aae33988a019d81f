"""The store's ZeroMQ server: one thread answering HELLO, PUT, GET and HAS (wire.py) from
a TieredStore, and the metrics it exposes (read from the store's counters at scrape time).

Authentication (with a token): a request whose MAC fails is answered by an untagged
"unauthorized" and not acted on; a sealed request whose stamp is of a session this store
did not issue, or repeats one (ReplayGuard), is answered "session" and not acted on.
Without a token (an open loopback store) every message is accepted, as on the KV sockets.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.kv.transport.frame_mac import FrameMac, ReplayGuard
from splitserve.kv_store.entry import StoreEntry
from splitserve.kv_store.tiers import TIERS, TieredStore
from splitserve.kv_store.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    GET,
    HAS,
    HELLO,
    MAC_LABEL,
    PUT,
    BlockKey,
    parse_blocks,
    parse_key,
    parse_meta,
)
from splitserve.protocol.kv_events import AllBlocksCleared
from splitserve.runtime.kv_events import KVEventPublisher

logger = logging.getLogger(__name__)

POLL_MS = 50
PREFIX = "splitserve_kv_store"


class KVStoreServer:
    def __init__(
        self,
        store: TieredStore,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        publisher: KVEventPublisher | None = None,  # the tiers' KV events (store: record_events)
    ) -> None:
        self.store = store
        self.publisher = publisher
        if publisher is not None:  # a (re)started store's subscribers forget what it held
            publisher.publish([AllBlocksCleared()])
        self.mac = FrameMac(token, MAC_LABEL)
        self.sessions = ReplayGuard()
        self.max_message_bytes = max_message_bytes
        self.refused = 0  # requests that failed authentication
        self.bad_requests = 0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # larger: dropped unread
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve, name="splitserve-kv-store", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.socket.close()
        self.context.term()
        if self.publisher is not None:
            self.publisher.shutdown()

    def serve(self) -> None:
        while not self.stopping.is_set():
            if not self.socket.poll(POLL_MS):
                continue
            identity, *frames = self.socket.recv_multipart()
            try:
                self.handle(identity, frames)
            except Exception:  # one bad message must not end the store
                logger.exception("KV store: a request failed")
                self.bad_requests += 1
            if self.publisher is not None:
                self.publisher.publish(self.store.take_events())

    def handle(self, identity: bytes, frames: list[bytes]) -> None:
        body = self.mac.open(frames)
        if body is None or len(body) < 2:
            self.refused += 1
            refusal = {"error": "unauthorized (not this deployment's internal token)", "code": "unauthorized"}
            self.socket.send_multipart([identity, json.dumps(refusal).encode()])
            return
        stamp = b""
        if self.mac.enabled:
            if len(body) < 3:
                self.refused += 1
                return
            stamp, body = body[-1], body[:-1]
        kind = body[0]
        if self.mac.enabled and kind != HELLO and not self.sessions.admit(stamp):
            self.reply(identity, stamp, {"error": "unknown session or a replay", "code": "session"}, [])
            return
        try:
            header = json.loads(body[1])
            if not isinstance(header, dict):
                raise ValueError("the header must be a JSON object")
            answer, data = self.answer(identity, kind, header, body[2:])
        except (ValueError, KeyError, TypeError) as exc:
            self.bad_requests += 1
            answer, data = {"error": f"bad request: {exc}", "code": "bad_request"}, []
        self.reply(identity, stamp, answer, data)

    def answer(
        self, identity: bytes, kind: bytes, header: dict, data: list[bytes]
    ) -> tuple[dict, list[bytes]]:
        if kind == HELLO:
            answer: dict = {"max_message_bytes": self.max_message_bytes}
            if self.mac.enabled:
                answer["session"] = self.sessions.issue(identity).hex()
            return answer, []
        blocks = parse_blocks(header)
        if kind == PUT:
            if len(data) != len(blocks):
                raise ValueError(f"{len(blocks)} blocks with {len(data)} payloads")
            stored = 0
            for block, payload in zip(blocks, data, strict=True):
                key = parse_key(block)
                entry = StoreEntry(key.block_hash, key.parent_hash, key.token_ids, parse_meta(block), payload)
                stored += self.store.put(entry)
            return {"stored": stored}, []
        keys = [parse_key(block) for block in blocks]
        if kind == GET:
            found = self.store.get_leading(keys)  # stops at a miss: only a leading run is of use
            blocks_found = [
                {
                    **BlockKey(entry.block_hash, entry.parent_hash, entry.token_ids).to_wire(),
                    "meta": entry.meta,
                    "tier": tier,
                }
                for entry, tier in found
            ]
            return {"blocks": blocks_found}, [entry.payload for entry, _ in found]
        if kind == HAS:
            count, tiers = 0, []
            for key in keys:
                if not self.store.contains(*key):
                    break
                count += 1
                tiers.append(self.store.tier_of(key.block_hash))
            return {"found": count, "tiers": tiers}, []
        raise ValueError(f"unknown kind {kind[:16]!r}")

    def reply(self, identity: bytes, stamp: bytes, answer: dict, data: list[bytes]) -> None:
        frames: list = [json.dumps(answer).encode(), *data]
        if self.mac.enabled:
            frames.append(stamp)  # binds the reply to the request it answers
        self.socket.send_multipart([identity, *self.mac.seal(frames)], copy=False)


class StoreCollector(Collector):
    """The store's counters per tier, read when scraped."""

    def __init__(self, server: KVStoreServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        stats = self.server.store.snapshot()
        per_tier = [
            ("hits", "Blocks found, by the tier that held them.", "hits", CounterMetricFamily),
            ("hit_bytes", "KV bytes served, by the tier that held them.", "hit_bytes", CounterMetricFamily),
            ("bytes", "KV bytes held, per tier.", "stored_bytes", GaugeMetricFamily),
            ("blocks", "Blocks held, per tier.", "blocks", GaugeMetricFamily),
            ("evictions", "Blocks pushed out of a tier (RAM: to disk).", "evictions", CounterMetricFamily),
        ]
        for name, doc, attr, family in per_tier:
            metric = family(f"{PREFIX}_{name}", doc, labels=["tier"])
            for tier in TIERS:
                metric.add_metric([tier], getattr(stats.tiers[tier], attr))
            yield metric
        totals = [
            ("puts", "Blocks offered to the store.", stats.puts),
            ("put_bytes", "KV bytes offered to the store.", stats.put_bytes),
            ("misses", "Lookups of a block the store does not hold.", stats.misses),
            ("mismatches", "Lookups of a held hash with other tokens or parent: a miss.", stats.mismatches),
            ("corrupt", "Disk entries that failed their checksum: a miss, removed.", stats.corrupt),
            ("too_large", "Blocks larger than a tier's whole budget, not kept there.", stats.too_large),
            ("refused", "Requests that failed authentication.", self.server.refused),
            ("bad_requests", "Requests refused as malformed.", self.server.bad_requests),
        ]
        for name, doc, value in totals:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
