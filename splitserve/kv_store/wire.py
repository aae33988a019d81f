"""The KV store's wire: the messages, their checks, and the client an engine uses.

The framing and its protection are the KV transport's (kv/transport/frame_mac.py, as in
control_channel.py): a request is `[kind, JSON header, data frames..., stamp]` sealed with
a MAC keyed from the deployment's internal token (the store's own label, so a store
message is never valid on an engine's KV socket, nor the reverse). The stamp is the
session the store issued at HELLO plus a sequence number (ReplayGuard on the store), and a
reply `[JSON, data frames..., the request's stamp]` is sealed too, so a client takes only
the answer to its own request. Unlike control_channel.py's replies, a store's carry data
(a GET's blocks), and the client is a plain request/reply socket, not a send lane.

Kinds (every block named by its hash, its parent's hash and its token IDs):
  HELLO {}                                  -> {session, max_message_bytes}
  PUT   {blocks: [{hash, parent, tokens, meta}]} + one payload frame per block -> {stored}
  GET   {blocks: [{hash, parent, tokens}]}  -> {blocks: [{meta, tier}]} + one frame each,
                                               the leading blocks found (stops at a miss)
  HAS   {blocks: [...]}                     -> {found, tiers}: how many leading blocks a GET finds
Errors: {error, code}; code "unauthorized" comes untagged (we share no key with the asker),
"session" when the store does not know the request's session (it restarted): the client
says HELLO again and retries once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, NamedTuple

import zmq

from splitserve.kv.transport.frame_mac import FrameMac, SenderSession, hello_stamp

logger = logging.getLogger(__name__)

MAC_LABEL = b"splitserve kv store v1"
HELLO, PUT, GET, HAS = b"HELLO", b"PUT", b"GET", b"HAS"
KINDS = (HELLO, PUT, GET, HAS)
MAX_BLOCKS_PER_MESSAGE = 4096
MAX_TOKENS_PER_BLOCK = 4096
MAX_HASH_BYTES = 64
MAX_META_BYTES = 4096
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


class StoreError(Exception):
    """The store refused a request, or did not answer in time (a miss to the caller)."""


class BlockKey(NamedTuple):
    """What names a block in the store: its chained hash, and for verification its
    parent's hash and its token IDs."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "hash": self.block_hash.hex(),
            "parent": self.parent_hash.hex() if self.parent_hash is not None else None,
            "tokens": list(self.token_ids),
        }


def parse_hash(value: object, name: str) -> bytes:
    if not isinstance(value, str) or not 0 < len(value) <= 2 * MAX_HASH_BYTES:
        raise ValueError(f"{name} must be a hex block hash")
    return bytes.fromhex(value)  # ValueError for anything not hex


def parse_key(block: object) -> BlockKey:
    """A block named on the wire (ValueError naming what is wrong)."""
    if not isinstance(block, dict):
        raise ValueError("a block must be an object")
    parent = block.get("parent")
    tokens = block.get("tokens")
    if not isinstance(tokens, list) or not 0 < len(tokens) <= MAX_TOKENS_PER_BLOCK:
        raise ValueError(f"tokens must be a list of 1 to {MAX_TOKENS_PER_BLOCK} token IDs")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in tokens):
        raise ValueError("tokens must be non-negative integers")
    return BlockKey(
        parse_hash(block.get("hash"), "hash"),
        None if parent is None else parse_hash(parent, "parent"),
        tuple(tokens),
    )


def parse_blocks(header: dict) -> list[dict]:
    blocks = header.get("blocks")
    if not isinstance(blocks, list) or len(blocks) > MAX_BLOCKS_PER_MESSAGE:
        raise ValueError(f"blocks must be a list of at most {MAX_BLOCKS_PER_MESSAGE}")
    return blocks


def parse_meta(block: dict) -> dict:
    meta = block.get("meta", {})
    if not isinstance(meta, dict) or len(json.dumps(meta)) > MAX_META_BYTES:
        raise ValueError(f"meta must be an object of at most {MAX_META_BYTES} bytes")
    return meta


class FoundBlock(NamedTuple):
    """A block a GET found: what the store says it holds (for the caller to verify), its
    payload and the tier it came from."""

    key: BlockKey
    meta: dict
    payload: bytes
    tier: str


class StoreClient:
    """Put, get and has against one store; thread-safe (one request at a time). Every
    failure raises StoreError: a store that is down, slow or refuses us costs a miss."""

    def __init__(self, host: str, port: int, token: str | None, timeout_s: float = 2.0) -> None:
        self.address = f"tcp://{host}:{port}"
        self.mac = FrameMac(token, MAC_LABEL)
        self.timeout_s = timeout_s
        self.context = zmq.Context()
        self.lock = threading.Lock()
        self.session: SenderSession | None = None  # None until the store answered HELLO
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        return socket

    def close(self) -> None:
        with self.lock:
            self.socket.close()
            self.context.term()

    def retarget(self, host: str, port: int) -> None:
        """Talk to the store at host:port from the next request on (a replaced store): a
        fresh socket and session, so nothing of the old store's is taken for the new one's."""
        with self.lock:
            self.address = f"tcp://{host}:{port}"
            self._reset()

    # ---- the operations ------------------------------------------------------------
    def put(self, blocks: list[tuple[BlockKey, dict, bytes]]) -> int:
        """Store blocks (key, meta, payload); how many the store kept."""
        header = {"blocks": [{**key.to_wire(), "meta": meta} for key, meta, _ in blocks]}
        answer, _ = self.request(PUT, header, [payload for _, _, payload in blocks])
        return int(answer.get("stored", 0))

    def get(self, keys: list[BlockKey]) -> list[FoundBlock]:
        """The leading blocks the store holds for these keys."""
        answer, frames = self.request(GET, {"blocks": [key.to_wire() for key in keys]})
        found = answer.get("blocks", [])
        if not isinstance(found, list) or len(found) != len(frames) or len(found) > len(keys):
            raise StoreError("the KV store's GET answer does not match its data")
        try:
            return [
                FoundBlock(parse_key(block), parse_meta(block), frames[i], str(block.get("tier")))
                for i, block in enumerate(found)
            ]
        except ValueError as exc:
            raise StoreError(f"the KV store's GET answer is malformed: {exc}") from exc

    def has(self, keys: list[BlockKey]) -> int:
        """How many of the leading keys the store holds (for these tokens)."""
        answer, _ = self.request(HAS, {"blocks": [key.to_wire() for key in keys]})
        return int(answer.get("found", 0))

    # ---- the exchange ----------------------------------------------------------------
    def request(self, kind: bytes, header: dict, data: list[bytes] | None = None) -> tuple[dict, list[bytes]]:
        with self.lock:
            for attempt in range(2):
                if self.session is None:
                    self._hello()
                assert self.session is not None
                stamp = self.session.next_stamp() if self.mac.enabled else b""
                answer, frames = self._exchange(kind, header, data or [], stamp)
                if answer.get("code") == "session" and attempt == 0:
                    self.session = None  # the store restarted: a new session, once
                    continue
                if "error" in answer:
                    raise StoreError(f"the KV store refused {kind.decode()}: {answer['error']}")
                return answer, frames
            raise StoreError("the KV store keeps refusing our session")

    def _hello(self) -> None:
        answer, _ = self._exchange(HELLO, {}, [], hello_stamp() if self.mac.enabled else b"")
        session = SenderSession()
        if self.mac.enabled:
            try:
                session.start(bytes.fromhex(str(answer["session"])))
            except (KeyError, ValueError) as exc:
                raise StoreError("the KV store answered HELLO without a session") from exc
        self.session = session

    def _exchange(
        self, kind: bytes, header: dict, data: list[bytes], stamp: bytes
    ) -> tuple[dict, list[bytes]]:
        frames: list[Any] = [kind, json.dumps(header).encode(), *data]
        if self.mac.enabled:
            frames.append(stamp)
        deadline = time.monotonic() + self.timeout_s
        try:
            self.socket.send_multipart(self.mac.seal(frames), copy=False)
            while (left := deadline - time.monotonic()) > 0 and self.socket.poll(int(left * 1000) + 1):
                reply = self.socket.recv_multipart()
                body = self.mac.open(reply)
                if body is None:
                    raise StoreError(f"the KV store at {self.address} refused us: {_unsealed_error(reply)}")
                if self.mac.enabled:
                    if len(body) < 2 or body[-1] != stamp:
                        continue  # not the answer to this request (a late or replayed one)
                    body = body[:-1]
                return json.loads(body[0]), list(body[1:])
        except (zmq.ZMQError, ValueError) as exc:
            self._reset()
            raise StoreError(f"the KV store at {self.address}: {exc}") from exc
        except StoreError:
            self._reset()
            raise
        self._reset()
        raise StoreError(f"the KV store at {self.address} did not answer in {self.timeout_s:g} s")

    def _reset(self) -> None:
        """A fresh socket and session: nothing late from the old one can be mistaken."""
        self.socket.close()
        self.socket = self._connect()
        self.session = None


def _unsealed_error(frames: list[bytes]) -> str:
    """What an untagged answer says (a store with another token, or a forgery)."""
    try:
        return str(json.loads(frames[0]).get("error", "a reply failed authentication"))
    except (ValueError, IndexError, AttributeError):
        return "a reply failed authentication"
