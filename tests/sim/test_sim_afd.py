"""Attention-FFN disaggregation in the simulator: the vLLM AFD plugin's comparison (DeepSeek
decode at 16K input, 48 attention + 16 FFN chips and 64 + 16 against 64-way expert
parallelism) on the roofline, what dual micro-batch overlap and the link do, and `sim afd`'s
answer for the attention:FFN ratio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.sim import Efficiency, load_gpu, load_model
from splitserve.sim.afd import AFDModel, AFDRun, Layout, compare, parse_layouts, ratio_layouts
from splitserve.sim.analysis import cut_points

DS, CHIP = load_model("DeepSeek-V3"), load_gpu("Ascend-910C")
PLUGIN = [Layout(48, 16), Layout(64, 16)]
# the plugin's benchmark as the seed reports it: per-chip output vs EP64
PUBLISHED = {"48A+16F": (-0.10, -0.05), "64A+16F": (0.09, 0.11)}


def plugin_model(**run) -> AFDModel:
    """DeepSeek decode at 16K context, FP8 weights (as DeepSeek-V3 ships; the plugin runs
    W8A8), dual micro-batch overlap; each role's batch from its own memory unless `run` pins
    it or says otherwise."""
    return AFDModel(DS, CHIP, Efficiency(), AFDRun(context=16384, weight_bytes=1, **run))


def plugin_run(**run) -> dict:
    result = compare(plugin_model(**run), 64, PLUGIN)
    rows = {r["layout"]: r for r in result["layouts"]}
    return {"batch": result["batch"], "EP64": result["baseline"], **rows}


def test_the_cut_figure_is_what_the_model_moves():
    """`sim cuts`'s 1.59 MiB per token per pass is one copy out and one back per MoE layer:
    what the AFD model sends per token copy."""
    moved_per_copy = DS.hidden * DS.dtype_bytes
    assert (
        2 * moved_per_copy * DS.moe_layers
        == cut_points(load_model("Qwen2.5-7B"), DS)["af_bytes_per_token_per_pass"]
    )
    afd = AFDModel(DS, CHIP)
    # a token's top-8 experts over 16 FFN chips land on ~6.3 of them
    assert afd.copies_per_token(16) == pytest.approx(16 * (1 - (15 / 16) ** 8))


def test_memory_per_role():
    """An EP64 chip holds every weight but the routed experts plus 4 of the 256; an attention
    chip (split) only attention, router, dense layers, embeddings and head; an FFN chip of 16
    its 16 routed experts and the shared one. What is left of 90% of 128 GB holds KV of whole
    16K sequences (61 layers x (512 latent + 64 rope) x 2 bytes per token, 1.15 GB each)."""
    afd = plugin_model()
    per_layer = DS.expert_params * DS.moe_layers  # one expert in every MoE layer
    routed = DS.experts * per_layer
    kv_per_seq = 61 * (512 + 64) * 2 * 16384
    assert afd.kv_bytes_per_sequence() == kv_per_seq
    ep = afd.memory(Layout(64, 0), 64)
    assert ep.attention_weight_bytes == DS.total_params - routed + 4 * per_layer
    assert ep.ffn_weight_bytes == 0
    assert ep.batch == int((0.9 * 128e9 - ep.attention_weight_bytes) // kv_per_seq) == 76
    split = afd.memory(Layout(48, 16), 64)
    assert split.attention_weight_bytes == DS.total_params - routed - per_layer  # no shared expert
    assert split.ffn_weight_bytes == (16 + 1) * per_layer
    assert split.batch == int((0.9 * 128e9 - split.attention_weight_bytes) // kv_per_seq) == 87
    assert split.attention_kv_bytes == 87 * kv_per_seq
    assert afd.memory(Layout(64, 16), 64).batch == 87  # the attention chips' memory is per chip
    # `ep`: an attention chip holds an EP64 chip's weights, so the EP64 batch
    same = plugin_model(attention_weights="ep").memory(Layout(48, 16), 64)
    assert same.attention_weight_bytes == ep.attention_weight_bytes and same.batch == 76
    with pytest.raises(ValueError, match="attention weights"):
        AFDRun(attention_weights="full")
    # 64 routed experts per FFN chip (4 FFN chips) do not fit (the table marks it), nor EP over 2 chips
    assert not plugin_model().ffn_fits(Layout(76, 4)) and plugin_model().ffn_fits(Layout(72, 8))
    with pytest.raises(ValueError, match="do not fit"):
        plugin_model().memory(Layout(2, 0), 2)


def test_the_plugins_direction():
    """With each role's batch from its memory (87 sequences per attention chip against 76 per
    EP chip): 48+16 is slower than EP64 per chip, 64+16 gives more per chip than 48+16 (more
    attention chips feed the same experts more tokens) and the FFN chips keep headroom (the
    authors' note). 64+16 does not beat EP64 here: at 16K the absorbed MLA attention is
    compute-bound, so a chip's attention time grows with its batch and 15% more sequences buy
    only the per-step overhead and the head (docs/sim.md)."""
    r = plugin_run()
    low, high = r["48A+16F"], r["64A+16F"]
    assert low["batch_per_attention_chip"] == high["batch_per_attention_chip"] == 87
    assert r["EP64"]["batch_per_attention_chip"] == 76
    lo, hi = PUBLISHED["48A+16F"]
    # published 5-10% slower; the model lands within 3 points beyond that range (-12.9%)
    assert lo - 0.03 <= low["vs_baseline"] <= hi
    assert high["tokens_per_s_per_chip"] > low["tokens_per_s_per_chip"]
    assert high["tokens_per_expert"] == pytest.approx(low["tokens_per_expert"] * 64 / 48)
    for row in (low, high):
        assert row["bound"] == "attention" and row["ffn_busy"] < 0.7
    # published 9-11% faster; the model stays 7.1% behind, 16 points short
    assert -0.08 < high["vs_baseline"] < 0
    # memory moves both by a fraction of a point against one batch for all
    pinned = plugin_run(attention_weights="ep")
    for name in ("48A+16F", "64A+16F"):
        assert 0 < r[name]["vs_baseline"] - pinned[name]["vs_baseline"] < 0.01


def test_batch_pins_every_layout():
    """`--batch` sets the batch per attention chip (and per EP chip) in every layout, as
    before memory per role: the same figures as attention chips holding an EP chip's
    weights, whose batch is the EP64 one (76)."""
    pinned, as_ep = plugin_run(batch=76), plugin_run(attention_weights="ep")
    for name in ("EP64", "48A+16F", "64A+16F"):
        assert pinned[name]["batch_per_attention_chip"] == 76
        assert pinned[name]["tokens_per_s_per_chip"] == pytest.approx(as_ep[name]["tokens_per_s_per_chip"])
    assert pinned["48A+16F"]["vs_baseline"] == pytest.approx(-0.132, abs=0.001)
    assert pinned["64A+16F"]["vs_baseline"] == pytest.approx(-0.074, abs=0.001)
    small = plugin_run(batch=8)
    assert all(small[name]["batch_per_attention_chip"] == 8 for name in ("EP64", "48A+16F", "64A+16F"))


def test_the_published_pair_cannot_both_hold_at_one_batch():
    """When the attention chips set the step (FFN headroom), adding attention chips changes
    only the share of chips doing attention: per chip, 64+16 = 48+16 x (64/80)/(48/64). From
    48+16 at -5% (the published best) that is +1.3%, short of the published +9%. Memory per
    role does not change this: an attention chip's batch depends on its own memory, not on
    how many there are, so both layouts run the same batch."""
    r = plugin_run()
    share = (64 / 80) / (48 / 64)
    assert 1 + r["64A+16F"]["vs_baseline"] == pytest.approx((1 + r["48A+16F"]["vs_baseline"]) * share)
    best_48 = PUBLISHED["48A+16F"][1]
    assert (1 + best_48) * share - 1 < PUBLISHED["64A+16F"][0]


def test_overlap_and_the_link():
    """Without dual micro-batch overlap each MoE layer waits for the round trip: AFD loses
    far more. Over a 200 Gb/s NIC instead of the chips' fabric the link binds."""
    overlapped, serial = plugin_run(), plugin_run(overlap=False)
    for name in ("48A+16F", "64A+16F"):
        assert serial[name]["vs_baseline"] < overlapped[name]["vs_baseline"] - 0.2
        assert serial[name]["bound"] == "round trip"
    slow = plugin_run(link_bw=25e9)
    assert slow["64A+16F"]["bound"] in ("round trip", "link")
    assert slow["64A+16F"]["tokens_per_s_per_chip"] < overlapped["64A+16F"]["tokens_per_s_per_chip"]


def test_layouts_and_bad_input():
    assert parse_layouts("48:16,64:0") == [Layout(48, 16), Layout(64, 0)]
    with pytest.raises(ValueError, match="ATTENTION:FFN"):
        parse_layouts("48-16")
    splits = ratio_layouts(80, 256)
    assert splits[0] == Layout(80, 0) and all(256 % lay.ffn == 0 for lay in splits[1:])
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        AFDModel(load_model("Qwen2.5-7B"), CHIP)
    with pytest.raises(ValueError, match="hybrid"):
        AFDModel(load_model("Nemotron-3-Nano-30B-A3B"), CHIP)


def sim(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cli", "sim", "afd", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_sim_afd_answers_the_ratio():
    """`sim afd --model DeepSeek-V3 --chips 80` (dense MLA): every split with its per-chip
    output; the splits whose FFN chips cannot hold the experts are marked; the best is named;
    64+16 is the best AFD split."""
    proc = sim("--model", "DeepSeek-V3", "--chips", "80", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["attention_weights"] == "split" and data["batch"] == 76  # EP80's
    rows = {r["layout"]: r for r in data["layouts"]}
    assert not rows["79A+1F"]["fits"] and rows["64A+16F"]["fits"]
    assert rows["64A+16F"]["batch_per_attention_chip"] == 87
    memory = rows["64A+16F"]["memory"]
    assert memory["attention_kv_bytes"] == 87 * memory["kv_bytes_per_sequence"]
    assert memory["ffn_weight_bytes"] > 0 and data["baseline"]["memory"]["ffn_weight_bytes"] == 0
    fitting = [r for r in data["layouts"] if r["fits"]]
    assert data["best"] == max(fitting, key=lambda r: r["tokens_per_s_per_chip"])["layout"]
    afd_only = [r for r in fitting if r["ffn_chips"]]
    assert max(afd_only, key=lambda r: r["tokens_per_s_per_chip"])["layout"] == "64A+16F"
    table = sim("--model", "DeepSeek-V3", "--layouts", "48:16,64:16", "--baseline", "64")
    assert table.returncode == 0 and "64A+16F" in table.stdout and "vs EP64" in table.stdout
    assert "14.6 + 100.2 | 43.4" in table.stdout  # an attention chip's weights + KV, an FFN chip's
    as_ep = sim(
        "--model", "DeepSeek-V3", "--layouts", "48:16,64:16", "--baseline", "64", "--attention-weights", "ep"
    )
    assert as_ep.returncode == 0 and "-13.2%" in as_ep.stdout and "-7.4%" in as_ep.stdout
    pinned = sim(
        "--model", "DeepSeek-V3", "--layouts", "48:16,64:16", "--baseline", "64", "--batch", "76", "--json"
    )
    assert {r["batch_per_attention_chip"] for r in json.loads(pinned.stdout)["layouts"]} == {76}
    bad = sim("--layouts", "48-16")
    assert bad.returncode == 2 and "ATTENTION:FFN" in bad.stderr
    dense = sim("--model", "Qwen2.5-7B")
    assert dense.returncode == 2 and "not a mixture-of-experts" in dense.stderr
