"""Per-request Mamba state slots for hybrid models, beside the paged KV pool.

A Mamba layer's memory of a request is one fixed-size state (conv buffer + SSM state),
not per-token KV, so it is held in a slot of its own pool: one slot per running request,
taken at admission and given back at finish, abort and preemption (a preempted request
recomputes from its first token, so its state is rebuilt from zero). The pool owns the
state tensors and its accounting; `check_integrity` compares that accounting with the
requests that hold slots, as BlockManager.check_integrity does for blocks.

A hybrid model's prefix-cache hit would need the state as of the hit's end, which no slot
keeps: the engine disables prefix caching for hybrid models (see docs/models.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from splitserve.model.mamba2 import MambaMetadata, MambaPrefill, MambaShape

if TYPE_CHECKING:
    from splitserve.engine.scheduler import ScheduledRequest


class MambaStatePool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,  # Mamba layers
        shape: MambaShape,
        conv_dtype: torch.dtype,  # the model dtype (the convolution's inputs)
        device: torch.device,
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

    def step_metadata(self, ordered: list[ScheduledRequest], device: torch.device) -> MambaMetadata:
        """The Mamba layers' view of a step whose rows are `ordered` (decode-like first).
        A request starting at position 0 starts from a zero state."""
        decode_slots: list[int] = []
        prefills: list[MambaPrefill] = []
        floors: list[torch.Tensor] = []
        offset = 0
        for item in ordered:
            slot = self.slots[item.request.request_id]
            if item.position_start == 0:
                self.conv_states[slot].zero_()
                self.ssm_states[slot].zero_()
            if item.num_tokens == 1:
                decode_slots.append(slot)
            else:
                prefills.append(MambaPrefill(offset, item.num_tokens, slot))
            positions = torch.arange(item.position_start, item.position_start + item.num_tokens)
            is_prompt = positions < item.request.num_prompt_tokens
            floors.append(is_prompt.float() * self.time_step_min)
            offset += item.num_tokens
        dt_floor = torch.cat(floors) if floors else torch.zeros(0)
        return MambaMetadata(
            num_decode_tokens=len(decode_slots),
            decode_slots=torch.tensor(decode_slots, dtype=torch.long, device=device),
            prefills=prefills,
            dt_floor=dt_floor.to(device),
            conv_states=self.conv_states,
            ssm_states=self.ssm_states,
        )

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
