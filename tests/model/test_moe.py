"""The grouped expert computation against a per-token float64 reference, the router's
normalization, and the two checkpoint layouts of the experts."""

from __future__ import annotations

import pytest
import torch

from splitserve.model.decoder import load_model
from splitserve.model.decoder_config import moe_config_from_hf
from splitserve.model.loader import load_decoder_config
from splitserve.model.moe import SparseMoeBlock, grouped_experts, route
from splitserve.model.tiny_moe import TinyMoeSpec


def per_token_reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """Each token, each of its experts, one at a time, in float64."""
    x, weights, gate_up, down = (t.double() for t in (x, weights, gate_up, down))
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(7, 5, 3, 13, 11), (1, 4, 4, 9, 5), (33, 9, 2, 17, 6), (0, 3, 2, 8, 4)],
)
def test_grouped_experts_equal_the_per_token_reference(tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden, generator=g)
    # distinct experts per token; where it can, the last expert gets no token at all
    pool = experts - 1 if experts > top_k else experts
    rows = [torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)]
    ids = torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    got = grouped_experts(x, ids, weights, gate_up, down)
    assert got.shape == (tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(
        got.double(), per_token_reference(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5
    )


def test_router_top_k_and_its_normalization():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, 2, norm_topk_prob=False)
    assert ids.tolist() == [[1, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normed, same_ids = route(logits, 2, norm_topk_prob=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(normed.sum(-1), torch.ones(2))
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))


def test_config_reads_both_expert_count_names_and_refuses_bad_top_k():
    raw = {
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "mlp_only_layers": [1],
    }
    moe = moe_config_from_hf(raw)
    assert (moe.num_experts, moe.top_k, moe.mlp_only_layers, moe.decoder_sparse_step) == (6, 2, (1,), 1)
    assert [moe.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok 7"):
        moe_config_from_hf({**raw, "num_experts_per_tok": 7})


def test_fused_expert_layout_loads_like_the_per_expert_files(tiny_model_factory):
    """transformers 5 holds the experts fused ([E, 2I, H] and [E, H, I]); its state dict
    loads into the same model as the per-expert files save_pretrained writes."""
    from transformers import AutoModelForCausalLM

    spec = TinyMoeSpec(decoder_sparse_step=2, mlp_only_layers=(3,))
    model_dir = tiny_model_factory(arch="qwen3_moe", layers=4, moe=spec)
    config = load_decoder_config(model_dir)
    from_files = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp) is SparseMoeBlock for layer in from_files.layers]
    assert kinds == [False, True, False, False]  # every 2nd layer, except layer 3
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = reference.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    with torch.device("meta"):
        from_fused = type(from_files)(config)
    from_fused = from_fused.to_empty(device="cpu")
    from_fused.load_weights(state.items())
    for name, param in from_files.named_parameters():
        assert torch.equal(param, dict(from_fused.named_parameters())[name]), name
