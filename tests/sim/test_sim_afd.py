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


def plugin_run(**run) -> dict:
    """DeepSeek decode at 16K context, FP8 weights (as DeepSeek-V3 ships; the plugin runs
    W8A8), the same batch per attention chip in every layout (the plugin keeps full weights on
    both roles, so memory is the same), dual micro-batch overlap."""
    afd = AFDModel(DS, CHIP, Efficiency(), AFDRun(context=16384, weight_bytes=1, **run))
    result = compare(afd, 64, PLUGIN)
    return {"batch": result["batch"], **{r["layout"]: r for r in result["layouts"]}}


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


def test_the_plugins_direction():
    """48+16 is slower than EP64 per chip; 64+16 gives more per chip than 48+16 (the ratio
    decides: more attention chips feed the same experts more tokens), while the FFN chips
    keep headroom (the authors' note)."""
    r = plugin_run()
    low, high = r["48A+16F"], r["64A+16F"]
    lo, hi = PUBLISHED["48A+16F"]
    # published 5-10% slower; the model lands within 5 points of that range
    assert lo - 0.05 <= low["vs_baseline"] <= hi
    assert high["tokens_per_s_per_chip"] > low["tokens_per_s_per_chip"]
    assert high["tokens_per_expert"] == pytest.approx(low["tokens_per_expert"] * 64 / 48)
    for row in (low, high):
        assert row["bound"] == "attention" and row["ffn_busy"] < 0.7


def test_the_published_pair_cannot_both_hold_at_one_batch():
    """When the attention chips set the step (FFN headroom), adding attention chips changes
    only the share of chips doing attention: per chip, 64+16 = 48+16 x (64/80)/(48/64). From
    48+16 at -5% (the published best) that is +1.3%, short of the published +9%: the two
    figures need different batches per attention chip, which this model does not guess."""
    r = plugin_run()
    share = (64 / 80) / (48 / 64)
    assert 1 + r["64A+16F"]["vs_baseline"] == pytest.approx((1 + r["48A+16F"]["vs_baseline"]) * share)
    best_48 = PUBLISHED["48A+16F"][1]
    assert (1 + best_48) * share - 1 < PUBLISHED["64A+16F"][0]
    # at one batch, 64+16 stays behind EP64 here
    assert r["64A+16F"]["vs_baseline"] < 0


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
    """`sim afd --chips 80`: every split with its per-chip output; the splits whose FFN chips
    cannot hold the experts are marked; the best is named; 64+16 is the best AFD split."""
    proc = sim("--chips", "80", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {r["layout"]: r for r in data["layouts"]}
    assert not rows["79A+1F"]["fits"] and rows["64A+16F"]["fits"]
    fitting = [r for r in data["layouts"] if r["fits"]]
    assert data["best"] == max(fitting, key=lambda r: r["tokens_per_s_per_chip"])["layout"]
    afd_only = [r for r in fitting if r["ffn_chips"]]
    assert max(afd_only, key=lambda r: r["tokens_per_s_per_chip"])["layout"] == "64A+16F"
    table = sim("--layouts", "48:16,64:16", "--baseline", "64")
    assert table.returncode == 0 and "64A+16F" in table.stdout and "vs EP64" in table.stdout
    bad = sim("--layouts", "48-16")
    assert bad.returncode == 2 and "ATTENTION:FFN" in bad.stderr
    dense = sim("--model", "Qwen2.5-7B")
    assert dense.returncode == 2 and "not a mixture-of-experts" in dense.stderr
