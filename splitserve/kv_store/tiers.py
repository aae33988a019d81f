"""The store's tiers: RAM on top, an optional disk directory below, each an LRU with a
byte budget. A block lives in exactly one tier: a RAM entry pushed out by newer ones is
demoted to disk (or dropped without a disk tier, or when it is larger than the disk's
budget), and a disk hit is promoted back to RAM (its file removed).

An entry is a block's KV (opaque bytes and the engine's description of them, `meta`) keyed
by its chained block hash, with the parent hash and the block's token IDs beside it. The
hash already covers the whole prefix and the cache_salt; the parent and tokens are checked
again on every lookup, so a hash put with other tokens (a buggy or hostile writer) is a
miss, never KV for the wrong prefix.

A disk entry is one file, `<hash hex>.kv`: magic, header length, JSON header, payload,
then a blake2b digest of everything before it. A file that is truncated, altered or names
another hash fails the check and is a miss (the file is removed), never wrong KV.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"SSKVBLK1"
DIGEST_BYTES = 32
HEADER_LEN_BYTES = 4
SUFFIX = ".kv"
TIERS = ("ram", "disk")
# What an entry costs beyond its payload in the RAM budget: its token IDs and bookkeeping.
ENTRY_OVERHEAD_BYTES = 256


def prefix_digest(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """What a lookup must match besides the hash: the parent hash and the block's tokens."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\0" if parent_hash is None else b"\1" + parent_hash)
    h.update(json.dumps(list(token_ids)).encode())
    return h.digest()


@dataclass(frozen=True)
class StoreEntry:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    meta: dict  # the engine's description of the payload (dtype, shape); opaque here
    payload: bytes

    @property
    def check(self) -> bytes:
        return prefix_digest(self.parent_hash, self.token_ids)

    @property
    def cost(self) -> int:
        """Bytes it takes of a tier's budget."""
        return len(self.payload) + 8 * len(self.token_ids) + ENTRY_OVERHEAD_BYTES


def encode_entry(entry: StoreEntry) -> bytes:
    header = json.dumps(
        {
            "hash": entry.block_hash.hex(),
            "parent": entry.parent_hash.hex() if entry.parent_hash is not None else None,
            "tokens": list(entry.token_ids),
            "meta": entry.meta,
            "payload_bytes": len(entry.payload),
        }
    ).encode()
    body = MAGIC + len(header).to_bytes(HEADER_LEN_BYTES, "big") + header + entry.payload
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def decode_entry(data: bytes, block_hash: bytes) -> StoreEntry | None:
    """The entry a disk file holds, or None when it is truncated, corrupt or of another hash."""
    start = len(MAGIC) + HEADER_LEN_BYTES
    if len(data) < start + DIGEST_BYTES or not data.startswith(MAGIC):
        return None
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        return None
    header_len = int.from_bytes(body[len(MAGIC) : start], "big")
    try:
        header = json.loads(body[start : start + header_len])
        parent = header["parent"]
        entry = StoreEntry(
            block_hash=bytes.fromhex(header["hash"]),
            parent_hash=bytes.fromhex(parent) if parent is not None else None,
            token_ids=tuple(int(t) for t in header["tokens"]),
            meta=dict(header["meta"]),
            payload=body[start + header_len :],
        )
    except (ValueError, KeyError, TypeError):
        return None
    if entry.block_hash != block_hash or len(entry.payload) != header["payload_bytes"]:
        return None
    return entry


@dataclass
class TierStats:
    """One tier's counters (read by the server's metrics at scrape time)."""

    hits: int = 0
    hit_bytes: int = 0
    stored_bytes: int = 0
    blocks: int = 0
    evictions: int = 0


@dataclass
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    puts: int = 0
    put_bytes: int = 0
    misses: int = 0
    mismatches: int = 0  # the hash is held but for other tokens or another parent
    corrupt: int = 0  # disk entries that failed their check
    too_large: int = 0  # entries over a whole tier's budget, not kept


class RamTier:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[bytes, StoreEntry] = OrderedDict()  # least recent first
        self.used_bytes = 0

    def get(self, block_hash: bytes) -> StoreEntry | None:
        entry = self.entries.get(block_hash)
        if entry is not None:
            self.entries.move_to_end(block_hash)
        return entry

    def add(self, entry: StoreEntry) -> list[StoreEntry]:
        """Insert (or refresh) `entry`; the entries pushed out to stay in budget, oldest first."""
        self.remove(entry.block_hash)
        self.entries[entry.block_hash] = entry
        self.used_bytes += entry.cost
        pushed: list[StoreEntry] = []
        while self.used_bytes > self.budget_bytes and self.entries:
            _, oldest = self.entries.popitem(last=False)
            self.used_bytes -= oldest.cost
            pushed.append(oldest)
        return pushed

    def remove(self, block_hash: bytes) -> None:
        entry = self.entries.pop(block_hash, None)
        if entry is not None:
            self.used_bytes -= entry.cost


class DiskTier:
    """Entries as files in `directory`, at most `budget_bytes` of them; the index (which
    files, their sizes and checks, least recent first) is in memory, rebuilt at start from
    the files there (oldest modification first), so a restarted store keeps its disk tier."""

    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.index: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # hash -> (size, check)
        self.used_bytes = 0
        self.evictions = 0
        self.corrupt = 0
        self._rebuild_index()

    def path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def _rebuild_index(self) -> None:
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)  # a write cut short by a crash
        found: list[tuple[float, bytes, int, bytes]] = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                block_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
                entry = decode_entry(path.read_bytes(), block_hash)
                stat = path.stat()
            except (ValueError, OSError):
                entry = None
            if entry is None:
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, block_hash, stat.st_size, entry.check))
        for _, block_hash, size, check in sorted(found):
            self.index[block_hash] = (size, check)
            self.used_bytes += size
        self._shrink(0)

    def check(self, block_hash: bytes) -> bytes | None:
        """The stored entry's prefix check, without reading it (None: not held)."""
        held = self.index.get(block_hash)
        return held[1] if held is not None else None

    def read(self, block_hash: bytes) -> StoreEntry | None:
        """The entry; None when not held, or when its file failed the check (then removed
        and counted in `corrupt`)."""
        if block_hash not in self.index:
            return None
        try:
            entry = decode_entry(self.path(block_hash).read_bytes(), block_hash)
        except OSError:
            entry = None
        if entry is None:
            logger.warning("KV store: disk entry %s is corrupt or truncated: dropped", block_hash.hex())
            self.remove(block_hash)
            self.corrupt += 1
            return None
        self.index.move_to_end(block_hash)
        return entry

    def write(self, entry: StoreEntry) -> bool:
        """Keep `entry` (pushing out the least recent ones); False when it cannot fit at all
        or the write failed."""
        data = encode_entry(entry)
        if len(data) > self.budget_bytes:
            return False
        self.remove(entry.block_hash)
        self._shrink(len(data))
        path = self.path(entry.block_hash)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)  # a reader sees the whole file or none
        except OSError as exc:
            logger.warning("KV store: writing %s failed: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return False
        self.index[entry.block_hash] = (len(data), entry.check)
        self.used_bytes += len(data)
        return True

    def remove(self, block_hash: bytes) -> None:
        held = self.index.pop(block_hash, None)
        if held is not None:
            self.used_bytes -= held[0]
            with contextlib.suppress(OSError):
                self.path(block_hash).unlink(missing_ok=True)

    def _shrink(self, incoming: int) -> None:
        while self.index and self.used_bytes + incoming > self.budget_bytes:
            oldest = next(iter(self.index))
            self.remove(oldest)
            self.evictions += 1


class TieredStore:
    """RAM over an optional disk tier; thread-safe (one lock: the server's thread writes,
    the metrics scrape reads)."""

    def __init__(self, ram_bytes: int, disk_dir: str | Path | None = None, disk_bytes: int = 0) -> None:
        if ram_bytes <= 0:
            raise ValueError(f"the RAM tier needs a positive budget, not {ram_bytes} bytes")
        if disk_dir is not None and disk_bytes <= 0:
            raise ValueError(f"the disk tier needs a positive budget, not {disk_bytes} bytes")
        self.ram = RamTier(ram_bytes)
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        self.stats = StoreStats()
        self.lock = threading.Lock()

    def put(self, entry: StoreEntry) -> bool:
        """Keep `entry` in RAM (demoting what it pushes out); False when it is larger than
        the RAM budget."""
        with self.lock:
            self.stats.puts += 1
            self.stats.put_bytes += len(entry.payload)
            if entry.cost > self.ram.budget_bytes:
                self.stats.too_large += 1
                return False
            if self.disk is not None:
                self.disk.remove(entry.block_hash)  # one tier holds a block
            self._add_to_ram(entry)
            return True

    def _add_to_ram(self, entry: StoreEntry) -> None:
        for pushed in self.ram.add(entry):
            self.stats.tiers["ram"].evictions += 1
            if self.disk is not None and not self.disk.write(pushed):
                self.stats.too_large += 1

    def get(
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]
    ) -> StoreEntry | None:
        """The entry for this hash, parent and tokens; None on a miss, a mismatch or a
        corrupt disk entry."""
        found = self.get_leading([(block_hash, parent_hash, token_ids)])
        return found[0][0] if found else None

    def get_leading(
        self, keys: list[tuple[bytes, bytes | None, tuple[int, ...]]]
    ) -> list[tuple[StoreEntry, str]]:
        """(entry, tier it came from) for the leading run of `keys` held for their parent and
        tokens, up to the first miss, mismatch or corrupt disk entry. The RAM hits are
        touched first, then the disk hits move up to RAM: promoting a chain's disk blocks
        does not push its own RAM blocks down (while RAM holds the chain)."""
        with self.lock:
            held: list[tuple[bytes, str]] = []
            for block_hash, parent_hash, token_ids in keys:
                check = prefix_digest(parent_hash, token_ids)
                entry = self.ram.entries.get(block_hash)
                stored = entry.check if entry is not None else None
                tier = "ram"
                if entry is None and self.disk is not None:
                    stored, tier = self.disk.check(block_hash), "disk"
                if stored is None:
                    self.stats.misses += 1
                    break
                if stored != check:
                    self.stats.mismatches += 1
                    break
                held.append((block_hash, tier))
            for block_hash, tier in held:
                if tier == "ram":
                    self.ram.entries.move_to_end(block_hash)
            found: list[tuple[StoreEntry, str]] = []
            for block_hash, tier in held:
                read = self.ram.entries.get(block_hash) if tier == "ram" else self._read_disk(block_hash)
                if read is None:
                    break
                found.append((read, tier))
                stats = self.stats.tiers[tier]
                stats.hits += 1
                stats.hit_bytes += len(read.payload)
            for entry, tier in found:
                if tier == "disk":
                    assert self.disk is not None
                    self.disk.remove(entry.block_hash)
                    self._add_to_ram(entry)
            return found

    def _read_disk(self, block_hash: bytes) -> StoreEntry | None:
        assert self.disk is not None
        return self.disk.read(block_hash)

    def contains(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bool:
        """Whether a get would find it (a disk entry's file is checked only when read)."""
        check = prefix_digest(parent_hash, token_ids)
        with self.lock:
            entry = self.ram.entries.get(block_hash)
            if entry is not None:
                return entry.check == check
            return self.disk is not None and self.disk.check(block_hash) == check

    def tier_of(self, block_hash: bytes) -> str | None:
        with self.lock:
            if block_hash in self.ram.entries:
                return "ram"
            if self.disk is not None and block_hash in self.disk.index:
                return "disk"
            return None

    def snapshot(self) -> StoreStats:
        """The counters now, with each tier's bytes and blocks filled in."""
        with self.lock:
            ram, disk = self.stats.tiers["ram"], self.stats.tiers["disk"]
            ram.stored_bytes, ram.blocks = self.ram.used_bytes, len(self.ram.entries)
            if self.disk is not None:
                disk.stored_bytes, disk.blocks = self.disk.used_bytes, len(self.disk.index)
                disk.evictions = self.disk.evictions
                self.stats.corrupt = self.disk.corrupt
            return StoreStats(
                tiers={name: TierStats(**vars(t)) for name, t in self.stats.tiers.items()},
                **{k: v for k, v in vars(self.stats).items() if k != "tiers"},
            )
