"""Nemotron-H's MoE layers (E) piece by piece: the sigmoid grouped top-k router against
transformers' NemotronHTopkRouter, the non-gated grouped experts against a per-token
float64 reference, the config's checks, and a model with a latent projection loaded from
the per-expert files transformers' save_pretrained writes and from its fused state dict
(greedy tokens equal transformers')."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.llm import LLM
from splitserve.model import ops
from splitserve.model.moe import grouped_experts, route_grouped_sigmoid
from splitserve.model.nemotron_h import load_nemotron_h
from splitserve.model.nemotron_h_config import load_nemotron_h_config, moe_config_of
from splitserve.protocol.sampling_params import SamplingParams
from tests.engine.helpers import make_prompts, oracle_greedy


@pytest.mark.parametrize(
    ("experts", "groups", "top_groups", "top_k", "norm", "scale"),
    [(8, 2, 1, 2, True, 2.5), (16, 4, 2, 3, False, 1.0), (6, 1, 1, 2, True, 1.0), (12, 3, 3, 4, True, 0.5)],
)
def test_router_equals_transformers(experts, groups, top_groups, top_k, norm, scale):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    hidden, tokens = 24, 40
    g = torch.Generator().manual_seed(experts * 10 + top_k)
    config = SimpleNamespace(
        num_experts_per_tok=top_k,
        num_local_experts=experts,
        hidden_size=hidden,
        routed_scaling_factor=scale,
        n_group=groups,
        topk_group=top_groups,
        norm_topk_prob=norm,
    )
    reference = NemotronHTopkRouter(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(experts, hidden, generator=g))
        reference.e_score_correction_bias.copy_(0.5 * torch.randn(experts, generator=g))
    x = torch.randn(tokens, hidden, generator=g) / hidden**0.5
    _, want_weights, want_ids = reference(x)
    weights, ids = route_grouped_sigmoid(
        F.linear(x, reference.weight),
        reference.e_score_correction_bias,
        groups,
        top_groups,
        top_k,
        norm,
        scale,
    )
    # both choose with topk(sorted=False): compare each token's choice in id order
    want_ids, want_order = want_ids.sort(dim=-1)
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=0, atol=0)
    assert weights.dtype == torch.float32


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "width", "inter"), [(9, 6, 2, 12, 5), (1, 4, 3, 7, 3)]
)
def test_non_gated_experts_equal_the_per_token_reference(tokens, experts, top_k, width, inter):
    g = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, width, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    up = torch.randn(experts, inter, width, generator=g) / width**0.5
    down = torch.randn(experts, width, inter, generator=g) / inter**0.5
    got = grouped_experts(x, ids, weights, up, down, ops.relu_squared)
    want = torch.zeros(tokens, width, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            hidden = torch.relu(up[e].double() @ x[t].double()) ** 2
            want[t] += weights[t, j].double() * (down[e].double() @ hidden)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_config_refuses_routers_transformers_cannot_run():
    raw = {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "moe_shared_expert_intermediate_size": 8,
        "n_group": 2,
        "topk_group": 1,
    }
    moe = moe_config_of(raw)
    assert (moe.num_groups, moe.top_groups, moe.latent_size, moe.routed_scaling_factor) == (2, 1, None, 1.0)
    for bad, message in (
        ({"n_group": 3}, "must divide"),
        ({"n_group": 8}, "at least 2 experts"),
        ({"topk_group": 3}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ):
        with pytest.raises(ValueError, match=message):
            moe_config_of({**raw, **bad})


def random_latent_model(directory: Path) -> Path:
    """transformers' own Nemotron-H with two MoE layers behind a latent projection, its
    weights redrawn so that activations stay O(1), written by save_pretrained."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=256,
        hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=32,
        moe_latent_size=16,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("proj", "proj.weight", "conv1d.weight", "gate.weight", "lm_head.weight")):
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
            elif name.endswith("embeddings.weight"):
                param.copy_(torch.randn_like(param))
        for layer in (1, 3):
            gate = model.model.layers[layer].mixer.gate
            gate.weight.mul_(3.0)
            gate.e_score_correction_bias.copy_(0.2 * torch.randn(8))
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(directory)
    return directory


def test_latent_moe_loads_from_both_layouts_and_equals_transformers(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model_dir = random_latent_model(tmp_path / "per-expert")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in names  # the Hub's layout
    assert "backbone.layers.1.mixer.fc1_latent_proj.weight" in names
    config = load_nemotron_h_config(model_dir)
    assert config.moe is not None and config.moe.latent_size == 16

    prompts = make_prompts(256, seed=3)[:4]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [r.token_ids for r in LLM(str(model_dir), num_blocks=32).generate(prompts, greedy)]
    assert tokens == oracle_greedy(str(model_dir), prompts, 8)

    # the fused layout transformers holds in memory (`mixer.experts.up_proj` [E, I, latent])
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert state["model.layers.1.mixer.experts.up_proj"].shape == (8, 24, 16)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((model_dir / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused_dir / "model.safetensors"))
    cpu = torch.device("cpu")
    from_files = load_nemotron_h(str(model_dir), config, torch.float32, cpu)
    from_fused = dict(load_nemotron_h(str(fused_dir), config, torch.float32, cpu).named_parameters())
    for name, param in from_files.named_parameters():
        assert torch.equal(param, from_fused[name]), name
