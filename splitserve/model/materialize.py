"""Modules are built on the meta device (no memory, no random init) and then given real,
uninitialised storage before their weights load."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def materialize(module: ModuleT, device: torch.device | str) -> ModuleT:
    """`module.to_empty(device=device)`, at a fraction of its start-up cost: `to_empty` calls
    `empty_like` on meta tensors, whose first call imports torch's symbolic shapes and sympy
    (~0.4 s per process, paid by every engine start); `torch.empty` of the same shape and
    dtype needs neither. `_apply` is the method `to_empty` itself is built on."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
