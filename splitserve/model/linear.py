"""nn.Linear whose weight can be prepacked for oneDNN after loading.

A bf16/fp16 matmul on the CPU through F.linear reorders the weight into oneDNN's
blocked layout on every call; at decode batch sizes that costs as much as the matmul
(measured here: 30 layers of the SmolLM2-135M shape, batch 1, ~1.8x faster prepacked).
Prepacking once, as inductor's weight freezing does, gives the same results bit for bit
without bias; with a bias, some ISAs round before adding it, one bf16 step apart at most
(tests/model/test_ops.py). float32 and CUDA keep F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if weight.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def prepack(self) -> None:
        """Replace the weight by its oneDNN-packed copy where that is faster. A weight
        shared with another module (a tied lm_head) is copied, not released."""
        weight = self.weight
        if not can_prepack(weight):
            return
        # batch hint 1: the layout chosen for decode; larger batches run as fast as F.linear
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.weight = None  # type: ignore[assignment]  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
