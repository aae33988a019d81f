"""Which steps dual micro-batch overlap splits, and how: a pure decode step of two or more
sequences, in two halves of its rows (the tokens are checked in test_afd.py)."""

from __future__ import annotations

import pytest
import torch

from splitserve.afd.microbatch import split_metadata, splits
from splitserve.model.attention import AttentionMetadata, PrefillChunk


def decode_meta(rows: int, prefill_tokens: int = 0) -> AttentionMetadata:
    chunks = (
        [PrefillChunk(rows, prefill_tokens, 0, torch.zeros(1, dtype=torch.int32))] if prefill_tokens else []
    )
    return AttentionMetadata(
        torch.arange(rows + prefill_tokens),
        rows,
        torch.arange(rows * 3, dtype=torch.int32).view(rows, 3),
        torch.arange(1, rows + 1, dtype=torch.int32),
        chunks,
    )


def test_only_pure_decode_steps_of_two_or_more_sequences_are_split():
    assert splits(decode_meta(2), 2) and splits(decode_meta(5), 2)
    assert not splits(decode_meta(5), 1)  # --afd-microbatches 1
    assert not splits(decode_meta(1), 2)  # one sequence
    assert not splits(decode_meta(4, prefill_tokens=8), 2)  # a prefill chunk beside the decodes


def test_the_halves_hold_their_own_rows():
    meta = decode_meta(5)
    first, second = split_metadata(meta, 2)
    assert first.num_decode_tokens == 2 and second.num_decode_tokens == 3
    assert first.slot_mapping.tolist() == [0, 1] and second.slot_mapping.tolist() == [2, 3, 4]
    assert torch.equal(
        torch.cat([first.decode_block_tables, second.decode_block_tables]), meta.decode_block_tables
    )
    assert second.decode_context_lens.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="cannot split"):
        split_metadata(meta, 5)
    with pytest.raises(ValueError, match="cannot split"):
        split_metadata(decode_meta(4, prefill_tokens=8), 2)
