"""The store's tiers: RAM on top, an optional disk directory below, each an LRU with a
byte budget. A block lives in exactly one tier: a RAM entry pushed out by newer ones is
demoted to disk (or dropped without a disk tier, or when it is larger than the disk's
budget), and a disk hit is promoted back to RAM (its file removed).

An entry (entry.py) is keyed by its chained block hash, which already covers the whole
prefix and the cache_salt; the parent hash and tokens beside it are checked again on every
lookup, so a hash put with other tokens (a buggy or hostile writer) is a miss, never KV
for the wrong prefix. A disk entry that fails its checksum is a miss too (disk_tier.py).

With `record_events`, every move is a KV event (BlockStored / BlockRemoved, vLLM's shape)
whose `medium` names the tier: "CPU" for RAM, "DISK" for disk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.kv_store.disk_tier import DiskTier
from splitserve.kv_store.entry import StoreEntry, prefix_digest
from splitserve.protocol.kv_events import BlockRemoved, BlockStored, KVCacheEvent

TIERS = ("ram", "disk")
# The `medium` of the KV events that announce which tier holds a block (vLLM's names).
MEDIUM = {"ram": "CPU", "disk": "DISK"}


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


class TieredStore:
    """RAM over an optional disk tier; thread-safe (one lock: the server's thread writes,
    the metrics scrape reads)."""

    def __init__(
        self,
        ram_bytes: int,
        disk_dir: str | Path | None = None,
        disk_bytes: int = 0,
        record_events: bool = False,
    ) -> None:
        if ram_bytes <= 0:
            raise ValueError(f"the RAM tier needs a positive budget, not {ram_bytes} bytes")
        if disk_dir is not None and disk_bytes <= 0:
            raise ValueError(f"the disk tier needs a positive budget, not {disk_bytes} bytes")
        self.ram = RamTier(ram_bytes)
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        self.stats = StoreStats()
        self.lock = threading.Lock()
        # which tier holds what, as KV events (BlockStored / BlockRemoved with a medium)
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        if self.disk is not None and record_events:
            self.disk.on_removed = []

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
        fresh = entry.block_hash not in self.ram.entries
        pushed_out = self.ram.add(entry)
        self._stored(entry, "ram", fresh)
        for pushed in pushed_out:
            self.stats.tiers["ram"].evictions += 1
            self._removed(pushed.block_hash, "ram")
            if self.disk is not None and self.disk.write(pushed):
                self._stored(pushed, "disk", True)
            elif self.disk is not None:
                self.stats.too_large += 1

    def _stored(self, entry: StoreEntry, tier: str, fresh: bool) -> None:
        self._flush_disk_removals()
        if self.events is not None and fresh:
            self.events.append(
                BlockStored(
                    block_hashes=[entry.block_hash],
                    parent_block_hash=entry.parent_hash,
                    token_ids=list(entry.token_ids),
                    block_size=len(entry.token_ids),
                    medium=MEDIUM[tier],
                )
            )

    def _removed(self, block_hash: bytes, tier: str) -> None:
        self._flush_disk_removals()
        if self.events is not None:
            self.events.append(BlockRemoved([block_hash], MEDIUM[tier]))

    def _flush_disk_removals(self) -> None:
        """The disk tier's removals, as events, in order with the rest."""
        if self.disk is not None and self.disk.on_removed and self.events is not None:
            self.events.append(BlockRemoved(list(self.disk.on_removed), MEDIUM["disk"]))
            self.disk.on_removed.clear()

    def take_events(self) -> list[KVCacheEvent]:
        """The tier changes since the last call (empty without record_events)."""
        with self.lock:
            self._flush_disk_removals()
            if not self.events:
                return []
            events, self.events = self.events, []
            return events

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
