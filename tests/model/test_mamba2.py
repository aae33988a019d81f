"""The Mamba2 pieces of hybrid models: the scan carries its state across split sequences,
the one-token recurrence equals the scan, the state pool's accounting, and the tiny
Nemotron-H that `splitserve tiny-model --arch nemotron_h` writes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from splitserve.cli import main
from splitserve.engine.state_pool import MambaStatePool
from splitserve.engine.state_snapshots import SnapshotKey, StateSnapshots
from splitserve.model.mamba2 import MambaShape, chunk_scan, recurrence_step
from splitserve.model.nemotron_h_config import load_nemotron_h_config

HEADS, HEAD_DIM, STATE, GROUPS = 4, 3, 5, 2
SHAPE = MambaShape(HEADS, HEAD_DIM, STATE, GROUPS, 4, 8, 0.001, True, False, 1e-5)


def scan_inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=g)
    dt = F.softplus(torch.randn(length, HEADS, generator=g))
    A = -torch.rand(HEADS, generator=g) - 0.5
    B = torch.randn(length, GROUPS, STATE, generator=g)
    C = torch.randn(length, GROUPS, STATE, generator=g)
    D = torch.randn(HEADS, generator=g)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("split", [1, 7, 8, 13])
def test_scan_split_anywhere_carries_the_state(split):
    x, dt, A, B, C, D = scan_inputs(21, seed=split)
    zero = torch.zeros(HEADS, HEAD_DIM, STATE)
    whole, whole_state = chunk_scan(x, dt, A, B, C, D, zero, chunk_size=8)
    first, state = chunk_scan(x[:split], dt[:split], A, B[:split], C[:split], D, zero, chunk_size=8)
    rest, final = chunk_scan(x[split:], dt[split:], A, B[split:], C[split:], D, state, chunk_size=8)
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, whole_state, rtol=1e-5, atol=1e-5)


def test_recurrence_equals_the_scan_token_by_token():
    x, dt, A, B, C, D = scan_inputs(10, seed=3)
    zero = torch.zeros(HEADS, HEAD_DIM, STATE)
    expected, expected_state = chunk_scan(x, dt, A, B, C, D, zero, chunk_size=4)
    state = zero.clone()[None]
    outputs = [
        recurrence_step(state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        for t in range(10)
    ]
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], expected_state, rtol=1e-5, atol=1e-5)


def test_state_pool_accounting():
    pool = MambaStatePool(3, 2, SHAPE, torch.float32, torch.device("cpu"), block_size=16)
    assert pool.snapshots is None  # no snapshot budget: no prefix hits
    assert pool.slot_bytes == 2 * (SHAPE.conv_dim * 3 + HEADS * HEAD_DIM * STATE) * 4
    assert pool.slot_bytes == MambaStatePool.bytes_per_slot(2, SHAPE, torch.float32)
    a, b = pool.allocate("a"), pool.allocate("b")
    assert a != b and pool.allocate("a") == a and pool.num_free_slots == 1
    pool.check_integrity(["a", "b"])
    with pytest.raises(AssertionError, match="differ"):
        pool.check_integrity(["a"])  # "b" holds a slot but is not running
    pool.allocate("c")
    with pytest.raises(ValueError, match="no free state slot"):
        pool.allocate("d")
    pool.free("b")
    pool.free("b")  # twice: nothing more
    pool.check_integrity(["a", "c"])
    pool.free_slots.append(a)  # a corrupted free list is caught
    with pytest.raises(AssertionError):
        pool.check_integrity(["a", "c"])


def test_snapshots_evict_least_recently_used():
    snapshots = StateSnapshots(2, (1, 3), (2,), torch.float32, torch.device("cpu"))
    keys = [SnapshotKey(bytes([i]) * 16, 16 * i, 16 * i) for i in range(3)]
    for i, key in enumerate(keys[:2]):
        snapshots.save(key, torch.full((1, 3), float(i)), torch.full((2,), float(i)))
    conv, ssm = torch.empty(1, 3), torch.empty(2)
    snapshots.restore(keys[0], conv, ssm)  # keys[0] is now the most recently used
    snapshots.save(keys[2], torch.full((1, 3), 2.0), torch.full((2,), 2.0))
    assert keys[0] in snapshots and keys[1] not in snapshots and keys[2] in snapshots
    snapshots.restore(keys[0], conv, ssm)
    assert conv.eq(0).all() and ssm.eq(0).all() and snapshots.num_evicted == 1
    snapshots.check_integrity()


def test_transformers_loads_the_tiny_model(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    directory = tiny_model_factory(arch="nemotron_h")
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert type(model).__name__ == "NemotronHForCausalLM"
    types = model.config.layers_block_type
    assert types.count("linear_attention") >= 2 and "full_attention" in types and "mlp" in types
    config = load_nemotron_h_config(directory)
    assert config.text.num_layers == types.count("full_attention")  # KV layers: the attention ones
    assert config.num_mamba_layers == types.count("linear_attention")


def test_cli_pattern_and_bad_patterns(tmp_path):
    assert (
        main(
            ["tiny-model", str(tmp_path / "m"), "--arch", "nemotron_h", "--pattern", "ME*-", "--vocab", "512"]
        )
        == 0
    )
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["hybrid_override_pattern"] == "ME*-" and raw["architectures"] == ["NemotronHForCausalLM"]
    assert (raw["n_routed_experts"], raw["num_experts_per_tok"], raw["n_group"]) == (8, 2, 2)
    moe = load_nemotron_h_config(tmp_path / "m").moe
    assert moe is not None and moe.shared_intermediate_size == raw["hidden_size"]
    for pattern in ("MM-", "MX*"):
        with pytest.raises(SystemExit, match="pattern"):
            main(["tiny-model", str(tmp_path / "bad"), "--arch", "nemotron_h", "--pattern", pattern])
    with pytest.raises(SystemExit, match="--pattern needs --arch nemotron_h"):
        main(["tiny-model", str(tmp_path / "bad"), "--arch", "qwen3", "--pattern", "M*"])
