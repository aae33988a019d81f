"""Per-request Mamba state slots for hybrid models, beside the paged KV pool.

A Mamba layer's memory of a request is one fixed-size state (conv buffer + SSM state),
not per-token KV, so it is held in a slot of its own pool: one slot per running request,
taken at admission and given back at finish, abort and preemption (a preempted request
recomputes from its first token, so its state is rebuilt from zero). The pool owns the
state tensors and its accounting; `check_integrity` compares that accounting with the
requests that hold slots, as BlockManager.check_integrity does for blocks.

Prefix caching: a step copies each request's state at every block boundary it computes
into the snapshot store (state_snapshots.py); a prefix hit is cut back to the latest
boundary with a snapshot, which admission copies into the request's new slot.

P/D (`hand_over_states`): a prefill request's step that reaches position n - 1 of its
n-token prompt also copies the state there (the decode worker computes the last prompt
token itself, from that state); the runner hands it to the KV connector as bytes
(`take_step_handoffs`), and a decode worker's slot is filled from those bytes
(`load_state`) once the request's KV and state have both arrived.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from splitserve.engine.state_snapshots import SnapshotKey, StateSnapshots, all_prompt_key
from splitserve.model.mamba2 import MambaMetadata, MambaPrefill, MambaShape
from splitserve.protocol.block_hash import BlockHash

if TYPE_CHECKING:
    from splitserve.engine.block_manager import BlockManager
    from splitserve.engine.request import Request, ScheduledRequest


def state_bytes(conv: torch.Tensor, ssm: torch.Tensor) -> bytes:
    """One request's state (every Mamba layer) as bytes: the conv state, then the SSM state."""
    parts = (t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in (conv, ssm))
    return b"".join(parts)


class MambaStatePool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,  # Mamba layers
        shape: MambaShape,
        conv_dtype: torch.dtype,  # the model dtype (the convolution's inputs)
        device: torch.device,
        block_size: int,
        snapshot_bytes: int = 0,  # the prefix snapshots' budget; 0: no prefix caching
    ) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self.shape = shape
        self.time_step_min = shape.time_step_min
        self.conv_states = torch.zeros(
            num_slots, num_layers, shape.conv_dim, shape.conv_kernel - 1, dtype=conv_dtype, device=device
        )
        self.ssm_states = torch.zeros(
            num_slots,
            num_layers,
            shape.num_heads,
            shape.head_dim,
            shape.state_size,
            dtype=torch.float32,
            device=device,
        )
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.slots: dict[str, int] = {}  # request ID -> its slot
        self.block_size = block_size
        num_snapshots = snapshot_bytes // self.slot_bytes
        self.snapshots = (
            StateSnapshots(
                num_snapshots, self.conv_states.shape[1:], self.ssm_states.shape[1:], conv_dtype, device
            )
            if num_snapshots > 0
            else None
        )
        # the boundaries the running step captures: (key, capture row) for those inside a
        # prefill chunk, (key, -1 - slot) for those at a row's end (read from the slot)
        self.step_captures: list[tuple[SnapshotKey, int]] = []
        # P/D prefill: capture each pushing request's state at its prompt's position n - 1,
        # as (request ID, capture row or -1 - slot) for the running step
        self.hand_over_states = False
        self.step_handoffs: list[tuple[str, int]] = []
        self.capture_conv: torch.Tensor | None = None
        self.capture_ssm: torch.Tensor | None = None

    @staticmethod
    def bytes_per_slot(num_layers: int, shape: MambaShape, conv_dtype: torch.dtype) -> int:
        """State bytes of one request (every Mamba layer), as `slot_bytes` of a pool."""
        conv = num_layers * shape.conv_dim * (shape.conv_kernel - 1) * conv_dtype.itemsize
        return conv + num_layers * shape.num_heads * shape.head_dim * shape.state_size * 4

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def slot_bytes(self) -> int:
        """State bytes of one request (every Mamba layer)."""
        return (
            self.conv_states[0].numel() * self.conv_states.element_size()
            + self.ssm_states[0].numel() * self.ssm_states.element_size()
        )

    def has_slot(self, request_id: str) -> bool:
        return request_id in self.slots

    def allocate(self, request_id: str) -> int:
        """A slot for the request (the one it holds, if any); ValueError when none is free."""
        if request_id in self.slots:
            return self.slots[request_id]
        if not self.free_slots:
            raise ValueError("no free state slot")
        slot = self.free_slots.pop()
        self.slots[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (nothing if it holds none)."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def snapshot_key(self, request: Request, num_blocks: int) -> SnapshotKey:
        """The key of the request's state after its first `num_blocks` blocks."""
        boundary = num_blocks * self.block_size
        return SnapshotKey(
            request.block_hashes[num_blocks - 1], boundary, min(request.num_prompt_tokens, boundary)
        )

    def announce_hits_in(self, block_manager: BlockManager) -> None:
        """Make the block manager's KV events announce a block only while a new request's
        hit can end after it: its KV cached and the snapshot at its end held (no residency
        that is not there, for the router's index); an evicted snapshot withdraws it."""
        if self.snapshots is None:
            return
        block_manager.announce = self.holds_prompt_snapshot

        def withdraw(key: SnapshotKey) -> None:
            if key.prompt_tokens == key.boundary:
                block_manager.withdraw(key.block_hash)

        self.snapshots.on_evict = withdraw

    def holds_prompt_snapshot(self, block_hash: BlockHash, block_index: int) -> bool:
        """Whether a new request's hit could end after this block (its snapshot is held)."""
        boundary = (block_index + 1) * self.block_size
        return self.snapshots is not None and all_prompt_key(block_hash, boundary) in self.snapshots

    def resumable_hit(self, request: Request, hit_blocks: list[int]) -> list[int]:
        """The longest leading part of a KV prefix hit whose end has a state snapshot."""
        if self.snapshots is None:
            return []
        for num_blocks in range(len(hit_blocks), 0, -1):
            if self.snapshot_key(request, num_blocks) in self.snapshots:
                return hit_blocks[:num_blocks]
        return []

    def restore(self, request: Request, num_blocks: int) -> None:
        """Start the request's slot from the snapshot after its first `num_blocks` blocks."""
        assert self.snapshots is not None
        slot = self.slots[request.request_id]
        self.snapshots.restore(
            self.snapshot_key(request, num_blocks), self.conv_states[slot], self.ssm_states[slot]
        )

    def step_metadata(self, ordered: list[ScheduledRequest], device: torch.device) -> MambaMetadata:
        """The Mamba layers' view of a step whose rows are `ordered` (decode-like first).
        A request starting at position 0 starts from a zero state."""
        decode_slots: list[int] = []
        prefills: list[MambaPrefill] = []
        floors: list[torch.Tensor] = []
        self.step_captures, self.step_handoffs = [], []
        num_inner = 0
        offset = 0
        for item in ordered:
            slot = self.slots[item.request.request_id]
            if item.position_start == 0:
                self.conv_states[slot].zero_()
                self.ssm_states[slot].zero_()
            start, end = item.position_start, item.position_start + item.num_tokens
            # the positions whose state the step keeps: block boundaries (snapshots), and a
            # pushing prefill request's n - 1 (its handoff); a position inside a prefill
            # chunk is a capture row, the row's end is read from the slot after the step
            snapshots: list[tuple[int, SnapshotKey]] = []
            if self.snapshots is not None:
                bs = self.block_size
                for boundary in range(-(-(start + 1) // bs) * bs, end + 1, bs):
                    snapshots.append((boundary, self.snapshot_key(item.request, boundary // bs)))
            handoff = self.handoff_position(item.request)
            wanted = {boundary for boundary, _ in snapshots}
            if handoff is not None and start < handoff <= end:
                wanted.add(handoff)
            source: dict[int, int] = {}
            inner: list[tuple[int, int]] = []
            for position in sorted(wanted):
                if position == end:
                    source[position] = -1 - slot
                else:
                    source[position] = num_inner
                    inner.append((position - start, num_inner))
                    num_inner += 1
            self.step_captures.extend((key, source[boundary]) for boundary, key in snapshots)
            if handoff in source:
                self.step_handoffs.append((item.request.request_id, source[handoff]))
            if item.num_tokens == 1:
                decode_slots.append(slot)
            else:
                prefills.append(MambaPrefill(offset, item.num_tokens, slot, tuple(inner)))
            positions = torch.arange(item.position_start, item.position_start + item.num_tokens)
            is_prompt = positions < item.request.num_prompt_tokens
            floors.append(is_prompt.float() * self.time_step_min)
            offset += item.num_tokens
        dt_floor = torch.cat(floors) if floors else torch.zeros(0)
        self.capture_conv = self.conv_states.new_empty(num_inner, *self.conv_states.shape[1:])
        self.capture_ssm = self.ssm_states.new_empty(num_inner, *self.ssm_states.shape[1:])
        return MambaMetadata(
            num_decode_tokens=len(decode_slots),
            decode_slots=torch.tensor(decode_slots, dtype=torch.long, device=device),
            prefills=prefills,
            dt_floor=dt_floor.to(device),
            conv_states=self.conv_states,
            ssm_states=self.ssm_states,
            capture_conv=self.capture_conv,
            capture_ssm=self.capture_ssm,
        )

    def handoff_position(self, request: Request) -> int | None:
        """Where a P/D prefill request's state is handed over: n - 1 (None: it is not)."""
        if not self.hand_over_states or not request.kv_transfer_params.do_remote_decode:
            return None
        return request.num_prompt_tokens - 1 if request.num_prompt_tokens > 1 else None

    def take_step_handoffs(self) -> list[tuple[str, bytes]]:
        """After the step ran: (request ID, its state as bytes) for each request whose
        handoff position the step reached (read before the next step reuses the rows)."""
        handoffs = []
        for request_id, source in self.step_handoffs:
            if source >= 0:
                assert self.capture_conv is not None and self.capture_ssm is not None
                conv, ssm = self.capture_conv[source], self.capture_ssm[source]
            else:
                conv, ssm = self.conv_states[-1 - source], self.ssm_states[-1 - source]
            handoffs.append((request_id, state_bytes(conv, ssm)))
        self.step_handoffs = []
        return handoffs

    def load_state(self, request_id: str, state: bytes) -> None:
        """Fill the request's slot from a state handed over whole (`take_step_handoffs`'
        bytes on the prefill worker). ValueError for bytes of another size."""
        if len(state) != self.slot_bytes:
            raise ValueError(f"a Mamba state of {len(state)} bytes, {self.slot_bytes} expected")
        slot = self.slots[request_id]
        raw = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        conv_bytes = self.conv_states[slot].numel() * self.conv_states.element_size()
        parts = ((self.conv_states[slot], raw[:conv_bytes]), (self.ssm_states[slot], raw[conv_bytes:]))
        for target, part in parts:
            target.copy_(part.view(target.dtype).view(target.shape))

    def save_step_snapshots(self) -> None:
        """After the step ran: keep the states at the boundaries it computed."""
        if self.snapshots is None:
            return
        assert self.capture_conv is not None and self.capture_ssm is not None
        for key, source in self.step_captures:
            if source >= 0:
                self.snapshots.save(key, self.capture_conv[source], self.capture_ssm[source])
            else:
                slot = -1 - source
                self.snapshots.save(key, self.conv_states[slot], self.ssm_states[slot])
        self.step_captures = []

    def check_integrity(self, holder_ids: Iterable[str]) -> None:
        """Raise AssertionError if the slot accounting differs from `holder_ids`, the
        requests that should hold a slot now (the running ones)."""
        holders = set(holder_ids)
        assert set(self.slots) == holders, (
            f"slot holders {sorted(self.slots)} differ from the running requests {sorted(holders)}"
        )
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "a state slot is held twice"
        assert len(set(self.free_slots)) == len(self.free_slots), "a state slot is free twice"
        assert set(used).isdisjoint(self.free_slots), "a held state slot is also free"
        assert len(used) + len(self.free_slots) == self.num_slots, "state slots were lost"
        if self.snapshots is not None:
            self.snapshots.check_integrity()
