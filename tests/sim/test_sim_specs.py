"""Specs: built-ins, HF config.json loading, custom GPUs; calibration; SLO metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.goodput import SLO
from splitserve.sim import Efficiency, Roofline, load_gpu, load_model, model_from_hf_config
from splitserve.sim.calibrate import CalibrationError, fit, parse_samples, synthetic_samples
from splitserve.sim.metrics import met, miss_fractions
from splitserve.sim.result import SimResult
from splitserve.sim.specs import GPUS, MODELS, SpecError

QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3_CONFIG = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
}


def test_builtins_cover_the_issue():
    assert {"L40S", "A100-80G", "H100-SXM", "H200", "B200"} <= set(GPUS)
    assert {"Qwen2.5-7B", "Llama-3.1-8B", "Llama-3.1-70B", "Qwen3-235B-A22B", "DeepSeek-V3"} <= set(MODELS)
    assert load_model("llama-3.1-70b").name == "Llama-3.1-70B"  # case-insensitive
    assert load_model("Qwen3-235B-A22B").total_params == pytest.approx(235e9, rel=0.01)
    assert load_model("Qwen3-235B-A22B").active_layer_params == pytest.approx(21e9, rel=0.05)
    ds = load_model("DeepSeek-V3")
    assert ds.total_params == pytest.approx(671e9, rel=0.01) and ds.kv_bytes_per_token == 70272
    assert load_model("Llama-3.1-8B").total_params == pytest.approx(8.03e9, rel=0.01)


def test_hf_config_matches_builtin(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    from_dir = load_model(str(tmp_path))
    from_file = load_model(str(tmp_path / "config.json"))
    builtin = load_model("Qwen2.5-7B")
    for m in (from_dir, from_file):
        assert m.layer_params == builtin.layer_params and m.kv_bytes_per_token == builtin.kv_bytes_per_token
        assert m.head_dim == 128 and not m.is_moe
    ds = model_from_hf_config(DEEPSEEK_V3_CONFIG)
    assert ds.is_mla and ds.kv_bytes_per_token == 70272 and ds.moe_layers == 58
    assert ds.total_params == load_model("DeepSeek-V3").total_params
    mixtral = model_from_hf_config({**QWEN25_7B_CONFIG, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.is_moe and mixtral.experts == 8 and mixtral.active_layer_params < mixtral.layer_params
    vlm = model_from_hf_config({"text_config": {**QWEN25_7B_CONFIG, "tie_word_embeddings": True}})
    assert vlm.tie_embeddings and vlm.total_params < builtin.total_params
    fp32 = model_from_hf_config({**QWEN25_7B_CONFIG, "torch_dtype": "float32"})
    assert fp32.kv_bytes_per_token == 2 * builtin.kv_bytes_per_token


def test_bad_specs_are_clear(tmp_path):
    with pytest.raises(SpecError, match="unknown model 'gpt-9'"):
        load_model("gpt-9")
    with pytest.raises(SpecError, match="unknown GPU"):
        load_gpu("TPU-v9")
    with pytest.raises(SpecError, match="no such file"):
        load_model(str(tmp_path / "nope" / "config.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="not readable JSON"):
        load_model(str(tmp_path / "bad.json"))
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SpecError, match="num_hidden_layers"):
        load_model(str(tmp_path / "partial.json"))
    (tmp_path / "gpu.json").write_text(json.dumps({"peak_flops": 1e12}))
    with pytest.raises(SpecError, match="mem_bw"):
        load_gpu(str(tmp_path / "gpu.json"))


def test_custom_gpu_json(tmp_path):
    (tmp_path / "cpu.json").write_text(
        json.dumps({"name": "laptop", "peak_flops": 1e12, "mem_bw": 50e9, "mem_bytes": 16e9})
    )
    cpu = load_gpu(str(tmp_path / "cpu.json"))
    assert cpu.name == "laptop" and cpu.ridge == 20.0


def test_moe_decode_reads_only_touched_experts():
    rl = Roofline(load_model("DeepSeek-V3"), load_gpu("H200"))
    one, many = rl.weights_read(1), rl.weights_read(4096)
    assert one < 0.1 * many  # one token touches 8 of 256 experts per layer
    assert many == pytest.approx((rl.model.layer_params + rl.model.head_params) * 2, rel=1e-6)


@pytest.mark.parametrize("truth", [Efficiency(0.4, 0.7, 0.003), Efficiency(0.6, 0.85, 0.001)])
def test_calibration_recovers_known_factors(truth):
    rl = Roofline(load_model("Qwen2.5-7B"), load_gpu("L40S"))
    res = fit(rl, synthetic_samples(rl, truth, noise=0.02, seed=5))
    assert res.eff.compute == pytest.approx(truth.compute, rel=0.05)
    assert res.eff.bandwidth == pytest.approx(truth.bandwidth, rel=0.05)
    assert res.eff.overhead_s == pytest.approx(truth.overhead_s, abs=0.0007)
    assert res.rms_rel_error < 0.05
    exact = fit(rl, synthetic_samples(rl, truth, noise=0.0))
    assert exact.eff.compute == pytest.approx(truth.compute, rel=1e-6)
    assert exact.max_rel_error < 1e-9


def test_calibration_input_errors():
    with pytest.raises(CalibrationError, match="non-empty"):
        parse_samples([])
    with pytest.raises(CalibrationError, match="kind"):
        parse_samples([{"kind": "both", "num_tokens": 1, "step_time_s": 1}])
    with pytest.raises(CalibrationError, match="step_time_s"):
        parse_samples([{"kind": "decode", "batch_size": 1}])
    samples, meta = parse_samples(
        {
            "model": "x",
            "samples": [{"kind": "decode", "num_tokens": 4, "context_len": 100, "step_time_s": 0.01}],
        }
    )
    assert samples[0].tokens == 4 and meta == {"model": "x"}


def test_slo_definitions():
    gaps = [np.array([0.02] * 98 + [0.5, 0.5]), np.array([0.02] * 10), np.zeros(0)]
    r = SimResult(
        arrival=np.zeros(3),
        ttft=np.array([1.0, 3.0, np.inf]),
        tpot=np.array([0.0248, 0.02, 0.0]),
        worst_gap=np.array([0.5, 0.02, 0.0]),
        e2e=np.array([5.0, 5.0, np.inf]),
        output=np.array([101, 11, 1]),
        gaps=gaps,
        busy_fraction=[0.5],
        mean_batch=[1.0],
        rejected=1,
        kv_peak=[0.0],
        kv_blocked=[0.0],
        roles=["both"],
    )
    assert list(met(SLO(ttft=2.0, tpot=0.030), r)) == [True, False, False]  # the average hides the stall
    assert list(met(SLO(ttft=5.0, gap=0.1), r)) == [False, True, False]
    assert list(met(SLO(p99_itl=0.1), r)) == [False, True, False]
    assert miss_fractions(SLO(ttft=2.0), r) == {"ttft": pytest.approx(2 / 3)}
    assert r.itl().shape == (110,)
    with pytest.raises(ValueError):
        SLO(ttft=-1)
    with pytest.raises(ValueError):
        SLO()


def test_calibration_with_attention_and_per_sequence_terms():
    rl = Roofline(load_model("Qwen2.5-7B"), load_gpu("L40S"))
    truth = Efficiency(0.5, 0.8, 0.002, attention=0.25, per_seq_overhead_s=0.0002)
    exact = fit(rl, synthetic_samples(rl, truth, noise=0.0), attention=True, per_seq=True)
    for field in ("compute", "bandwidth", "overhead_s", "attention", "per_seq_overhead_s"):
        assert getattr(exact.eff, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    noisy = fit(rl, synthetic_samples(rl, truth, noise=0.02, seed=3), attention=True, per_seq=True)
    assert noisy.eff.compute == pytest.approx(0.5, rel=0.05) and noisy.eff.attention == pytest.approx(
        0.25, rel=0.1
    )
    assert noisy.eff.bandwidth == pytest.approx(0.8, rel=0.08)
    assert noisy.eff.per_seq_overhead_s == pytest.approx(0.0002, rel=0.2)
    # the two-factor model cannot express it: a visibly worse fit
    assert fit(rl, synthetic_samples(rl, truth, noise=0.0)).rms_rel_error > 0.05
