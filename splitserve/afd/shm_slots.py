"""The same-host data path of attention-FFN disaggregation: a layer's tensors through a
shared-memory segment instead of ZeroMQ frames.

The attention engine owns the segment: a file created and unlinked at once by the KV
shm transport's own pieces (kv/transport/shm.py), so its memory goes with the engine
however it dies, and a peer reaches it only through the engine's open descriptor in
/proc. It holds `slots` slots (one per layer in flight: two micro-batches), each room
for `slot_tokens` tokens: the hidden states [T, H], the expert ids [T, k] (int32) and
weights [T, k] going out, the combined output [T, H] coming back. The engine writes a
layer into a free slot and sends the MOE header alone (sealed, as over tcp) naming the
slot; the daemon, which mapped the segment when the engine's HELLO offered it, computes
from the slot, writes the output into it, and answers with the header alone.

A segment lives for one HELLO: a reconnect (a dead or stuck daemon) makes a new one, so
a stopped daemon that wakes up later writes only into a segment nobody reads.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import NamedTuple

import torch

from splitserve.afd.wire import DTYPES
from splitserve.kv.transport.auto import host_node_id
from splitserve.kv.transport.shm import (
    create_pool,
    map_peer_pool,
    pool_still_owned,
    remove_stale_segments,
    segment_path,
)
from splitserve.kv.transport.types import TransferError
from splitserve.protocol.afd import SEGMENT_PREFIX, AfdProtocolError, ShmOffer

SLOTS = 2  # layers in flight at once: one per micro-batch
ALIGN = 64  # every tensor of a slot starts on a cache line


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


class SlotViews(NamedTuple):
    """One slot's tensors for a layer of `num_tokens` tokens, over the segment."""

    x: torch.Tensor  # [T, H], the layer's post-attention hidden states
    ids: torch.Tensor  # [T, k] int32
    weights: torch.Tensor  # [T, k]
    out: torch.Tensor  # [T, H], the combined expert output


class SlotLayout(NamedTuple):
    """Where a slot's tensors lie: both ends compute it from the model's layout and the
    engine's offer, so a message names only the slot."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype
    slots: int
    slot_tokens: int

    def regions(self) -> tuple[int, int, int, int]:
        """The bytes of x, ids, weights and out at full size, each aligned."""
        element = torch.empty((), dtype=self.dtype).element_size()
        hidden = _aligned(self.slot_tokens * self.hidden_size * element)
        return (
            hidden,
            _aligned(self.slot_tokens * self.top_k * 4),
            _aligned(self.slot_tokens * self.top_k * element),
            hidden,
        )

    def slot_bytes(self) -> int:
        return sum(self.regions())

    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes()

    def views(self, segment: torch.Tensor, slot: int, num_tokens: int) -> SlotViews:
        """AfdProtocolError for a slot this segment does not have or too many tokens."""
        if not 0 <= slot < self.slots:
            raise AfdProtocolError(f"slot {slot} is not one of the segment's {self.slots}")
        if num_tokens > self.slot_tokens:
            raise AfdProtocolError(f"{num_tokens} tokens do not fit a slot of {self.slot_tokens}")
        start = slot * self.slot_bytes()
        shapes = (
            ((num_tokens, self.hidden_size), self.dtype),
            ((num_tokens, self.top_k), torch.int32),
            ((num_tokens, self.top_k), self.dtype),
            ((num_tokens, self.hidden_size), self.dtype),
        )
        tensors = []
        for size, (shape, dtype) in zip(self.regions(), shapes, strict=True):
            count = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
            tensors.append(segment[start : start + count].view(dtype).view(shape))
            start += size
        return SlotViews(*tensors)


class EngineSegment:
    """The attention engine's segment for one HELLO (close() when the HELLO is superseded)."""

    def __init__(self, layout: SlotLayout) -> None:
        remove_stale_segments()  # a killed engine's left-over file, if one was killed mid-create
        self.layout = layout
        self.name = f"{SEGMENT_PREFIX}{secrets.token_hex(8)}"
        self.fd, self.buffer = create_pool(
            segment_path(os.getpid(), self.name), (layout.total_bytes(),), torch.uint8
        )

    def offer(self, node_id: str | None = None) -> ShmOffer:
        """What a HELLO says of it; `node_id`: this host's identity (None: its boot ID)."""
        return ShmOffer(
            self.name,
            os.getpid(),
            self.fd,
            node_id or host_node_id(),
            self.layout.slots,
            self.layout.slot_tokens,
        )

    def views(self, slot: int, num_tokens: int) -> SlotViews:
        return self.layout.views(self.buffer, slot, num_tokens)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)  # the mapping goes with the last reference to `buffer`


class PeerSegment(NamedTuple):
    """An engine's segment as the daemon mapped it."""

    offer: ShmOffer
    layout: SlotLayout
    buffer: torch.Tensor

    def views(self, slot: int, num_tokens: int) -> SlotViews:
        return self.layout.views(self.buffer, slot, num_tokens)

    def still_owned(self) -> bool:
        """Whether the engine still holds it (once it closed it, nobody reads it again)."""
        return pool_still_owned(self.offer.segment, self.offer.pid, self.offer.fd)


def map_engine_segment(offer: ShmOffer, hidden_size: int, top_k: int, dtype_name: str) -> PeerSegment:
    """The daemon's mapping of an engine's offered segment; TransferError when the engine
    is on another host or the segment is not what the offer says (not an AFD segment of
    that process, of our user, of exactly the layout's size)."""
    if offer.node_id is not None and offer.node_id != host_node_id():
        raise TransferError("the engine is on another host")
    layout = SlotLayout(hidden_size, top_k, DTYPES[dtype_name], offer.slots, offer.slot_tokens)
    buffer = map_peer_pool(offer.segment, offer.pid, offer.fd, (layout.total_bytes(),), torch.uint8)
    return PeerSegment(offer, layout, buffer)
