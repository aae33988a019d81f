"""The store's disk tier: entries as checksummed files (entry.py) in one directory, an LRU
with a byte budget."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from pathlib import Path

from splitserve.kv_store.entry import StoreEntry, decode_entry, encode_entry

logger = logging.getLogger(__name__)

SUFFIX = ".kv"


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
        self.on_removed: list[bytes] | None = None  # with events: the hashes that left, since taken
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
            if self.on_removed is not None:
                self.on_removed.append(block_hash)
            with contextlib.suppress(OSError):
                self.path(block_hash).unlink(missing_ok=True)

    def _shrink(self, incoming: int) -> None:
        while self.index and self.used_bytes + incoming > self.budget_bytes:
            oldest = next(iter(self.index))
            self.remove(oldest)
            self.evictions += 1
