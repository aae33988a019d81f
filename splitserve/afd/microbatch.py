"""Dual micro-batch overlap for an attention engine (the seed's "dual-batch overlap"): a
decode step of two or more sequences runs as two micro-batches, interleaved layer by
layer, so that while one micro-batch's MoE layer is on the wire and on the FFN daemon,
the other computes its attention:

    layer i:  attn(A) send(A)  attn(B) send(B)
    layer i+1: take(A) attn(A) send(A)  take(B) attn(B) send(B)  ...

`take(A)` at layer i+1 comes after B's attention at layer i: the time A's round trip
took beyond that attention is all the step waits for it. The sends do not wait
(FfnClient.submit; ZeroMQ's I/O thread moves the bytes), and both micro-batches may be
in flight at once.

This is the decoder's forward (model/decoder.py, DecoderModel.forward) with its rows
split in two: the same modules and ops in the same order per row, so the tokens are the
same (each decode row's attention reads only its own sequence's cache). Only pure decode
steps are split: a step carrying prefill chunks runs as one batch, as does one sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.afd.ffn_client import FfnClient, PendingLayer
from splitserve.model import ops
from splitserve.model.attention import AttentionMetadata
from splitserve.model.decoder import DecoderModel, LayerHook
from splitserve.model.moe import SparseMoeBlock

MICROBATCH_CHOICES = (1, 2)


def splits(meta: AttentionMetadata, microbatches: int) -> bool:
    """Whether a step with this metadata runs as two micro-batches."""
    return microbatches == 2 and meta.num_decode_tokens >= 2 and not meta.prefills


def split_metadata(meta: AttentionMetadata, rows: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """The metadata of a pure decode step's first `rows` rows and of the rest."""
    if meta.prefills or not 0 < rows < meta.num_decode_tokens:
        raise ValueError(f"cannot split a step of {meta.num_decode_tokens} decode rows at {rows}")

    def rows_of(part: slice) -> AttentionMetadata:
        return AttentionMetadata(
            meta.slot_mapping[part],
            part.stop - part.start,
            meta.decode_block_tables[part],
            meta.decode_context_lens[part],
            [],
        )

    return rows_of(slice(0, rows)), rows_of(slice(rows, meta.num_decode_tokens))


def overlapped_forward(
    model: DecoderModel,
    client: FfnClient,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
    before_layer: Callable[[int], None] | None = None,
    after_layer: LayerHook | None = None,
) -> torch.Tensor:
    """DecoderModel.forward's logits, the step run as two interleaved micro-batches."""
    half = meta.num_decode_tokens // 2
    metas = split_metadata(meta, half)
    rows = (slice(0, half), slice(half, meta.num_decode_tokens))
    residual = model.embed_tokens(input_ids)  # updated in place, a micro-batch's rows at a time
    cos, sin = model.rope(positions, residual.dtype)
    normed = model.layers[0].input_layernorm(residual)
    inputs = [normed[part] for part in rows]
    outputs: list[PendingLayer | torch.Tensor | None] = [None, None]  # the last MLP's, per micro-batch
    try:
        for i, layer in enumerate(model.layers):
            if before_layer is not None:
                before_layer(i)
            for m, part in enumerate(rows):
                if i > 0:  # the previous layer's MLP output, then this layer's input norm
                    norm = layer.input_layernorm
                    delta = take(client, outputs[m])
                    inputs[m] = ops.add_rms_norm(residual[part], delta, norm.weight, norm.eps)
                attn_out = layer.self_attn(inputs[m], cos[part], sin[part], kv_cache[i], metas[m])
                post_norm = layer.post_attention_layernorm
                x = ops.add_rms_norm(residual[part], attn_out, post_norm.weight, post_norm.eps)
                outputs[m] = send(client, i, layer.mlp, x)
            if after_layer is not None:  # both micro-batches' KV of layer i is written
                after_layer(i, kv_cache[i])
        mlp_out = torch.cat([take(client, output) for output in outputs])
    except BaseException:
        client.abandon()  # a failed step leaves nothing in flight to be sent again
        raise
    last = ops.add_rms_norm(
        residual[logits_indices], mlp_out[logits_indices], model.norm.weight, model.norm.eps
    )
    return model.lm_head(last)


def send(client: FfnClient, layer: int, mlp: torch.nn.Module, x: torch.Tensor) -> PendingLayer | torch.Tensor:
    """A sparse layer's tokens sent to the daemon (not waited for); a dense layer's MLP
    computed here."""
    if isinstance(mlp, SparseMoeBlock) and mlp.remote_experts is not None:
        weights, ids = mlp.route(x)
        return client.submit(layer, x, ids, weights)
    return mlp(x)


def take(client: FfnClient, output: PendingLayer | torch.Tensor | None) -> torch.Tensor:
    assert output is not None
    return client.collect(output) if isinstance(output, PendingLayer) else output
