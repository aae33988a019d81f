"""Mamba state snapshots at block boundaries: what makes a hybrid model's prefix hit.

A prefix hit hands a request the KV blocks of its first k blocks; a hybrid model also needs
every Mamba layer's state as of token k * block_size, which only a snapshot taken there
holds. Snapshots are keyed like the blocks, by the chained hash of the block that ends at
the boundary (all tokens before it, cache salt included), plus how many of those tokens
were prompt tokens of the request that computed them: transformers floors dt for prompt
tokens only (model/mamba2.py), so the state depends on that count, and a hit resumes only
from a state computed as transformers would compute it for the new request.

The store is a fixed number of snapshot rows, least recently used evicted first. A hit
resumes from the latest boundary that has both its KV block and a snapshot, never from a
partial state; evicting a snapshot can only shorten a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.protocol.block_hash import BlockHash


class SnapshotKey(NamedTuple):
    block_hash: BlockHash  # the block that ends at the boundary
    boundary: int  # the tokens before it
    prompt_tokens: int  # how many of them were prompt tokens when computed


def all_prompt_key(block_hash: BlockHash, boundary: int) -> SnapshotKey:
    """The key a new request's prefix hit ending at `boundary` looks for (a hit never
    covers the last prompt token, so every token before it is a prompt token)."""
    return SnapshotKey(block_hash, boundary, boundary)


class StateSnapshots:
    def __init__(
        self,
        num_rows: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        conv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_rows = num_rows
        self.conv = torch.zeros(num_rows, *conv_shape, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(num_rows, *ssm_shape, dtype=torch.float32, device=device)
        self.rows: OrderedDict[SnapshotKey, int] = OrderedDict()  # least recently used first
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))
        self.num_saved = 0
        self.num_evicted = 0
        self.on_evict: Callable[[SnapshotKey], None] | None = None  # told of every eviction

    def __contains__(self, key: SnapshotKey) -> bool:
        return key in self.rows

    def save(self, key: SnapshotKey, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Keep (a copy of) the state as of the key's boundary; a key already held is only
        marked as recently used (the same tokens give the same state)."""
        if key in self.rows:
            self.rows.move_to_end(key)
            return
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            evicted, row = self.rows.popitem(last=False)
            self.num_evicted += 1
            if self.on_evict is not None:
                self.on_evict(evicted)
        self.conv[row].copy_(conv)
        self.ssm[row].copy_(ssm)
        self.rows[key] = row
        self.num_saved += 1

    def restore(self, key: SnapshotKey, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Copy the key's snapshot into `conv` and `ssm` (a request's slot)."""
        row = self.rows[key]
        self.rows.move_to_end(key)
        conv.copy_(self.conv[row])
        ssm.copy_(self.ssm[row])

    def check_integrity(self) -> None:
        used = list(self.rows.values())
        assert len(set(used)) == len(used), "a snapshot row is held by two keys"
        assert set(used).isdisjoint(self.free_rows), "a held snapshot row is also free"
        assert len(used) + len(self.free_rows) == self.num_rows, "snapshot rows were lost"
