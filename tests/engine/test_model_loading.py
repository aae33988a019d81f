"""Checkpoint variants (sharded, tied embeddings, llama3 RoPE scaling, half dtypes), the
KV-cache allocator hook and the demo model, through the public Python API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.llm import LLM
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts, oracle_greedy
from tests.generate_requests import generate_request

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def edit_model(
    source: str, target: Path, config_changes: dict, drop: tuple[str, ...] = (), shards: int = 1
) -> str:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in load_file(str(target / "model.safetensors")).items() if k not in drop}
    if shards > 1:
        (target / "model.safetensors").unlink()
        names = sorted(weights)
        weight_map = {}
        for i in range(shards):
            filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[i::shards]}
            save_file(part, str(target / filename), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, filename))
        index = {"metadata": {}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def test_sharded_checkpoint_with_tied_embeddings(tiny_model_factory, tmp_path):
    model_dir = edit_model(
        tiny_model_factory(arch="llama"),
        tmp_path / "tied",
        {"tie_word_embeddings": True},
        drop=("lm_head.weight",),
        shards=3,
    )
    prompts = make_prompts(2048, seed=6)[:4]
    expected = oracle_greedy(model_dir, prompts, 10)
    assert [r.token_ids for r in LLM(model_dir, num_blocks=32).generate(prompts, GREEDY)] == expected


def test_llama3_rope_scaling(tiny_model_factory, tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model_dir = edit_model(tiny_model_factory(arch="llama"), tmp_path / "rope", {"rope_scaling": scaling})
    prompts = [make_prompts(2048, seed=7)[2]]  # 70 tokens: past the original context
    assert [r.token_ids for r in LLM(model_dir, num_blocks=32).generate(prompts, GREEDY)] == oracle_greedy(
        model_dir, prompts, 10
    )


def test_half_precision_checkpoints(tiny_model_factory):
    model_dir = tiny_model_factory(dtype="bfloat16")
    prompts = make_prompts(2048, seed=8)[:3]
    default = LLM(model_dir, num_blocks=32)
    # config.json's dtype unless told otherwise
    assert default.engine.model_info.dtype == "bfloat16"
    assert default.engine.kv_cache.dtype == torch.bfloat16
    # float32 over bf16 weights is exact: it equals transformers loading them as float32
    as_fp32 = LLM(model_dir, num_blocks=32, dtype="float32")
    assert [r.token_ids for r in as_fp32.generate(prompts, GREEDY)] == oracle_greedy(model_dir, prompts, 10)
    for dtype in ("bfloat16", "float16"):
        llm = LLM(model_dir, num_blocks=32, dtype=dtype)
        assert llm.engine.kv_cache.dtype == getattr(torch, dtype)
        results = llm.generate(prompts, GREEDY)
        assert all(len(r.token_ids) == 10 for r in results)


def test_kv_cache_allocator_hook_places_the_pool_in_a_shared_file(tiny_model, tmp_path):
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig
    from splitserve.engine.llm_engine import LLMEngine

    path = tmp_path / "kv.pool"
    calls = []

    def shared_allocator(shape, *, dtype, device):
        calls.append((tuple(shape), dtype))
        numel = 1
        for dim in shape:
            numel *= dim
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)

    engine = LLMEngine(
        EngineConfig(ModelConfig(tiny_model), CacheConfig(num_blocks=16)), kv_cache_allocator=shared_allocator
    )
    layers = engine.model_info.num_layers
    assert calls and calls[0][0][:4] == (layers, 2, 16, 16)
    assert engine.kv_cache.shape[2] == 16 and engine.kv_cache.shape[3] == engine.model_info.block_size
    prompt = make_prompts(2048, seed=9)[1]
    engine.add_request(generate_request("r", prompt, GREEDY))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == LLM(tiny_model, num_blocks=16).generate([prompt], GREEDY)[0].token_ids
    # the KV lives in the file: another mapping of it sees the written blocks
    other = torch.from_file(str(path), shared=True, size=engine.kv_cache.numel(), dtype=engine.kv_cache.dtype)
    assert torch.equal(other.view(engine.kv_cache.shape), engine.kv_cache)
    assert other.abs().sum() > 0


def test_llm_without_a_model_uses_the_demo_model(demo_home, demo_model, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_HOME", str(demo_home))
    llm = LLM(num_blocks=16)
    assert Path(llm.engine.config.model.model) == demo_model
    result = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def test_unknown_engine_argument_is_rejected(tiny_model):
    with pytest.raises(TypeError, match="num_blokcs"):
        LLM(tiny_model, num_blokcs=3)


def test_incomplete_checkpoint_is_rejected(tiny_model_factory, tmp_path):
    model_dir = edit_model(
        tiny_model_factory(arch="llama"),
        tmp_path / "broken",
        {},
        drop=("model.layers.1.self_attn.k_proj.weight",),
    )
    with pytest.raises(ValueError, match="qkv_proj"):
        LLM(model_dir, num_blocks=8)


def test_loading_a_model_and_generating_never_imports_torch_dynamo(tiny_model_factory):
    """torch._dynamo costs seconds to import; nothing an engine does needs it (meta-device
    math at model build once pulled it in on every start). Qwen2-VL: the decoder and M-RoPE."""
    model = tiny_model_factory(arch="qwen2_vl")
    script = (
        "import sys\n"
        "from splitserve.engine.llm import LLM\n"
        "from splitserve.protocol.sampling_params import SamplingParams\n"
        f"llm = LLM({model!r}, num_blocks=32)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
