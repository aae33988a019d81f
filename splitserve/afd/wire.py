"""Tensors as message frames, and the MAC both ends seal them with."""

from __future__ import annotations

import torch

from splitserve.kv.transport.frame_mac import FrameMac

MAC_LABEL = b"splitserve afd v1"  # its own key: a KV or encoder-cache message is never valid here
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def afd_mac(token: str | None) -> FrameMac:
    return FrameMac(token, MAC_LABEL)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_frame(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes (on the CPU, contiguous)."""
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def tensor_from_frame(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """ValueError when the frame does not hold exactly `shape` of `dtype`."""
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(f"a frame of {len(data)} bytes, expected {expected} for {list(shape)} {dtype}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
