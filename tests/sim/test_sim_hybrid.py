"""Hybrid (Mamba2 + attention) models in the simulator: the seed's Nemotron-H cut-points
figures, the real Nemotron-3-Nano's sizes, HF config parsing, the roofline's state reads and
Mamba state slots counted against memory by the simulator and the pool sizing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.sim import (
    Deployment,
    Roofline,
    load_gpu,
    load_model,
    model_from_hf_config,
    simulate,
    synthetic,
)
from splitserve.sim.analysis import decode_pool, mamba_break_even
from splitserve.sim.cmd_common import REALISTIC_EFFICIENCY
from splitserve.sim.kv import handoff_bytes
from splitserve.sim.specs import SpecError

KiB, MiB = 1024, 2**20
NANO, SEED = load_model("Nemotron-3-Nano-30B-A3B"), load_model("Nemotron-3-Nano-seed")
# what transformers 5.x writes for NVIDIA-Nemotron-3-Nano-30B-A3B (`layers_block_type`)
KIND = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
NANO_CONFIG = {
    "model_type": "nemotron_h",
    "hidden_size": 2688,
    "layers_block_type": [KIND[c] for c in NANO.pattern],
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1856,
    "mlp_hidden_act": "relu2",
    "vocab_size": 131072,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "mamba_ssm_cache_dtype": "float32",
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def test_the_seeds_example_reproduced():
    """The seed's program: 1.52 MiB of Mamba state per layer per request, 2 KiB of attention
    KV per token (per GPU at TP=2), break-even at 777 prompt tokens ("roughly 780")."""
    ssm = mamba_break_even(SEED, tp=2)
    assert f"{ssm['state_bytes'] / MiB:.2f}" == "1.52"
    assert f"{ssm['kv_bytes_per_token_layer'] / KiB:.0f}" == "2"
    assert f"{ssm['break_even_tokens']:,.0f}" == "777"
    # the SSM state (fp32) dominates; the conv buffer is the last 3 inputs of its channels
    assert ssm["ssm_state_bytes"] + ssm["conv_state_bytes"] == ssm["state_bytes"]
    assert ssm["conv_state_bytes"] == 3 * SEED.mamba.conv_channels(2) * SEED.dtype_bytes
    # a whole request: the state is fixed, the KV grows with the prompt
    short, _, long = ssm["handoff_per_gpu"]
    assert short["state_bytes"] == long["state_bytes"] == 23 * ssm["state_bytes"]
    assert long["kv_bytes"] == 64 * short["kv_bytes"]


def test_the_real_nemotron_3_nano():
    """The model card: 31.6B parameters, 3.2B active (embeddings aside); 23 Mamba, 23 MoE and
    6 attention layers. Its state per layer is smaller than the seed's example and its KV
    per token four times smaller (2 KV heads), so its break-even is later."""
    assert (NANO.mamba_layers, NANO.moe_layers, NANO.attention_layers, NANO.mlp_layers) == (23, 23, 6, 0)
    assert NANO.total_params == pytest.approx(31.6e9, rel=0.01)
    assert NANO.active_layer_params + NANO.head_params == pytest.approx(3.2e9, rel=0.03)
    real = mamba_break_even(NANO, tp=2)
    assert real["state_bytes"] < mamba_break_even(SEED, tp=2)["state_bytes"]
    assert real["kv_bytes_per_token_layer"] == 512
    assert 2000 < real["break_even_tokens"] < 2200
    # at TP=1 both halve... and double: the same break-even
    assert mamba_break_even(NANO, tp=1)["break_even_tokens"] == pytest.approx(real["break_even_tokens"])
    assert NANO.kv_bytes_per_token == 6 * 2 * 2 * 128 * 2
    with pytest.raises(ValueError, match="no Mamba layers"):
        mamba_break_even(load_model("Qwen2.5-7B"))


def test_hf_config_of_a_hybrid(tmp_path):
    spec = model_from_hf_config(NANO_CONFIG, name="nano")
    for field in ("layers", "pattern", "mamba", "experts", "shared_experts", "mlp_matrices", "kv_heads"):
        assert getattr(spec, field) == getattr(NANO, field), field
    assert spec.total_params == NANO.total_params
    # the older spelling: a pattern string, and num_hidden_layers
    legacy = {k: v for k, v in NANO_CONFIG.items() if k != "layers_block_type"}
    legacy.update(hybrid_override_pattern=NANO.pattern, num_hidden_layers=52)
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert load_model(str(tmp_path)).state_bytes_per_request == NANO.state_bytes_per_request
    # a dense Nemotron-H (a tiny test model's pattern): no MoE although the config carries
    # the MoE defaults
    tiny = {**NANO_CONFIG, "layers_block_type": [KIND[c] for c in "M-M*-M-"], "hidden_size": 64}
    dense = model_from_hf_config(tiny)
    assert not dense.is_moe and (dense.mamba_layers, dense.attention_layers, dense.mlp_layers) == (3, 1, 3)
    with pytest.raises(SpecError, match="unknown layers_block_type"):
        model_from_hf_config({**NANO_CONFIG, "layers_block_type": ["mamba", "conv"]})
    with pytest.raises(SpecError, match="mamba_num_heads"):
        model_from_hf_config({k: v for k, v in NANO_CONFIG.items() if k != "mamba_num_heads"})
    with pytest.raises(SpecError, match="52 layers, not 50"):
        model_from_hf_config({**legacy, "num_hidden_layers": 50})


def test_roofline_reads_and_hands_over_the_state():
    rl = Roofline(NANO, load_gpu("H200"), tp=2)
    # every decode step reads and writes each sequence's state; the KV grows with context
    one, two = rl.decode(1, 4096), rl.decode(2, 4096)  # same total context, one more sequence
    assert two.kv_bytes - one.kv_bytes == 2 * NANO.state_bytes_per_request
    # one all-reduce per hybrid layer (each is one mixer), not two
    dense = Roofline(load_model("Qwen2.5-7B"), load_gpu("H200"), tp=2)
    per_reduce = rl.comm_s(1) / NANO.layers
    assert dense.comm_s(1) / (2 * 28) == pytest.approx(per_reduce * 3584 / 2688, rel=0.5)
    # the P/D handoff: the attention KV plus the whole state, whatever the prompt length
    assert handoff_bytes(NANO, 8192) - handoff_bytes(NANO, 0) == 8192 * NANO.kv_bytes_per_token
    assert handoff_bytes(NANO, 0) == NANO.state_bytes_per_request


def test_decode_pool_counts_state_slots():
    """`sim tp`'s decode pool: a sequence holds its KV and its state, so fewer fit than the
    KV alone would allow."""
    gpu = load_gpu("H100-SXM")
    row = decode_pool(NANO, gpu, REALISTIC_EFFICIENCY, tp=1, context=4096, itl_slo_s=1.0)
    rl = Roofline(NANO, gpu, REALISTIC_EFFICIENCY)
    assert row["memory_cap"] == int(rl.cache_room_bytes() // NANO.cache_bytes(4096))
    assert row["memory_cap"] < rl.kv_capacity_tokens() // 4096
    assert row["limited_by"] == "memory" and row["batch"] == row["memory_cap"]


def test_simulator_reserves_a_state_slot_per_request(tmp_path):
    """A GPU with room for the KV of all 12 requests but the KV and state of only 3: the
    simulator never runs more than 3 at once, and the others wait for memory."""
    prompt, output = 1024, 32
    slot = Roofline(NANO, load_gpu("H200")).state_slot_tokens()  # the state in tokens of KV
    assert slot * NANO.kv_bytes_per_token >= NANO.state_bytes_per_request
    room = 3 * (slot + prompt + output) * NANO.kv_bytes_per_token + 1
    assert room > 12 * (prompt + output) * NANO.kv_bytes_per_token  # all 12 would fit without state
    weights_and_room = NANO.weight_bytes + room
    spec = {"name": "small", "peak_flops": 989e12, "mem_bw": 4.8e12, "mem_bytes": weights_and_room / 0.9}
    (tmp_path / "small.json").write_text(json.dumps(spec))
    dep = Deployment(NANO, load_gpu(str(tmp_path / "small.json")), replicas=1, kv_limit=True)
    result = simulate(dep, synthetic(rate=1000.0, n=12, prompt=prompt, output=output, seed=0))
    assert result.rejected == 0 and max(result.mean_batch) <= 3.0 + 1e-9
    assert result.kv_peak[0] == pytest.approx(1.0, abs=0.01)


def test_planner_sizes_pools_for_a_hybrid():
    """`sim plan` on the hybrid: the simulator it searches with reserves each request's state."""
    args = ["--model", "Nemotron-3-Nano-30B-A3B", "--gpu", "H200", "--rate", "4", "--prompt", "4096"]
    args += ["--output", "128", "--max-gpus", "2", "--max-requests", "800", "--iters", "2"]
    args += ["--slo", "custom", "--ttft", "2", "--tpot-ms", "60", "--budgets", "2048", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "sim", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plans = json.loads(proc.stdout)["plans"]
    assert plans and plans[0]["gpus"] == 1 and plans[0]["collocated"] == 1 and plans[0]["headroom"] > 0
