"""The pure-PyTorch path (what CUDA, or a machine without a compiler, runs) keeps the
oracle: greedy token IDs equal transformers' in float32."""

from __future__ import annotations

import pytest

from splitserve.engine.llm import LLM
from splitserve.model import ops
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts, oracle_greedy


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reference_ops_match_transformers(arch, tiny_model_factory, monkeypatch):
    calls: list[str] = []

    def no_kernels(tensor) -> bool:
        calls.append(tensor.device.type)
        return False

    monkeypatch.setattr(ops, "use_cpu_ops", no_kernels)
    model_dir = tiny_model_factory(arch=arch)
    prompts = make_prompts(2048, seed=3)
    llm = LLM(model_dir, num_blocks=64, max_num_batched_tokens=24)  # chunked prefill too
    results = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in results] == oracle_greedy(model_dir, prompts, 12)
    assert calls  # the references ran
