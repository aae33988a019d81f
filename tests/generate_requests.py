"""Typed generate requests for tests that drive the engine API directly (AsyncEngine,
LLMEngine), from the values a test has at hand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import KVTransferParams
from splitserve.protocol.multimodal import ImageInput
from splitserve.protocol.sampling_params import SamplingParams


def generate_request(
    request_id: str,
    prompt: Sequence[int],
    sampling_params: SamplingParams | None = None,
    *,
    cache_salt: str | None = None,
    kv_transfer_params: KVTransferParams | dict[str, Any] | None = None,
    images: Sequence[ImageInput] | None = None,
) -> GenerateRequest:
    """`kv_transfer_params` in wire form too (a prefill output's, a literal)."""
    if isinstance(kv_transfer_params, dict):
        kv_transfer_params = KVTransferParams.from_wire(kv_transfer_params)
    return GenerateRequest(
        request_id,
        tuple(prompt),
        sampling_params or SamplingParams(),
        cache_salt=cache_salt,
        kv_transfer_params=kv_transfer_params,
        images=tuple(images or ()),
    )
