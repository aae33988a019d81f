"""KV-cache sizes and the cost of moving them between a prefill and a decode instance."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.sim.specs import ModelSpec


def kv_bytes(model: ModelSpec, tokens: int) -> int:
    return tokens * model.kv_bytes_per_token


def handoff_bytes(model: ModelSpec, tokens: int) -> int:
    """What prefill hands decode for a `tokens`-token prompt: the attention layers' KV, and
    a hybrid model's Mamba state as of the prompt's end, whole (fixed, whatever the length)."""
    return model.cache_bytes(tokens)


def transfer_s(num_bytes: float, link_gbps: float, overhead_s: float = 0.0) -> float:
    """Seconds to move `num_bytes` over a link of `link_gbps` gigabits per second."""
    return num_bytes * 8 / (link_gbps * 1e9) + overhead_s


def exposed_transfer_s(
    num_bytes: float, layers: int, link_gbps: float, prefill_s: float, layerwise: bool
) -> float:
    """How much of a KV transfer lands on TTFT.

    Sent after prefill, all of it. Streamed layer by layer, each layer's share ships while
    the next layer computes: only the per-layer excess over compute (for every layer but the
    last) and the last layer's share are exposed.
    """
    total = transfer_s(num_bytes, link_gbps)
    if not layerwise:
        return total
    per_layer_xfer, per_layer_compute = total / layers, prefill_s / layers
    return max(0.0, per_layer_xfer - per_layer_compute) * (layers - 1) + per_layer_xfer


def required_gbps(model: ModelSpec, achieved_flops: float) -> float:
    """Link bandwidth that ships KV exactly as fast as prefill produces it (2 FLOPs per weight
    a token multiplies through: the decoder stack and the output head, not the embedding table)."""
    tokens_per_s = achieved_flops / (2 * (model.active_layer_params + model.head_params))
    return tokens_per_s * model.kv_bytes_per_token * 8 / 1e9


class KVReport(NamedTuple):
    model: str
    kv_bytes_per_token: int
    mha_bytes_per_token: int
    state_bytes: int  # a hybrid's Mamba state per request (0 without Mamba layers)
    tokens: int
    request_bytes: int
    link_gbps: float
    bulk_transfer_s: float
    prefill_s: float
    layerwise_exposed_s: float


def kv_report(model: ModelSpec, tokens: int, link_gbps: float, prefill_s: float) -> KVReport:
    size = handoff_bytes(model, tokens)
    return KVReport(
        model=model.name,
        kv_bytes_per_token=model.kv_bytes_per_token,
        mha_bytes_per_token=model.mha_kv_bytes_per_token,
        state_bytes=model.state_bytes_per_request,
        tokens=tokens,
        request_bytes=size,
        link_gbps=link_gbps,
        bulk_transfer_s=transfer_s(size, link_gbps),
        prefill_s=prefill_s,
        layerwise_exposed_s=exposed_transfer_s(size, model.layers, link_gbps, prefill_s, layerwise=True),
    )
