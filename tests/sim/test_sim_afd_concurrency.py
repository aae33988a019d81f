"""`sim afd --concurrency N` (a total of decode sequences split evenly across the attention
chips), `--sweep-concurrency` (where each layout is faster or slower than EP), and the
settings of the AFD plugin's DeepSeek-V3.2 recipe (per-die batches, EP without overlap,
forced expert balancing, DeepEP-Ascend's all-to-all latency), all through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.sim.afd_latency import ASCEND_LOW_LATENCY, all_to_all_latency_s, ascend_fixed_latency

PLUGIN = ("--layouts", "48:16,64:16", "--baseline", "64")
# the recipe (vllm-project/afd-plugin, recipe/npu/CAMP2pAFDConnector/deepseek_v3_2): dies,
# EP64 without DBO, four experts per rank, DeepEP-Ascend's latency
RECIPE = (
    *PLUGIN,
    "--gpu",
    "Ascend-910C-die",
    "--no-ep-overlap",
    "--experts-per-rank",
    "4",
    "--all-to-all-latency",
    "ascend",
)


def sim(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cli", "sim", "afd", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def sim_json(*args: str) -> dict:
    proc = sim(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_concurrency_splits_the_sequences_evenly_over_the_attention_chips():
    data = sim_json(*PLUGIN, "--concurrency", "2048")
    assert data["concurrency"] == 2048
    rows = [data["baseline"], *data["layouts"]]
    assert [r["batch_per_attention_chip"] for r in rows] == pytest.approx([32, 2048 / 48, 32])
    for r in rows:  # every layout decodes the same 2,048 sequences: per chip, 2,048 / chips / step
        assert r["tokens_per_s_per_chip"] == pytest.approx(2048 / r["chips"] / r["step_s"])
        assert r["tokens_per_expert"] == pytest.approx(2048 * 8 / 256)
    table = sim(*PLUGIN, "--concurrency", "2048")
    assert table.returncode == 0 and "42.67" in table.stdout and "32 sequences per chip" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--concurrency", "9000"), "EP64's 64 attention chips hold 67 sequences of 16,384 tokens"),
        (("--concurrency", "60"), "EP64 has 64 attention chips, one sequence each at least"),
        (("--concurrency", "0"), "--concurrency must be > 0"),
        (("--concurrency", "2048", "--batch", "8"), "--concurrency sets the batch per attention chip"),
        (("--concurrency", "2048", "--sweep-concurrency", "64:128:64"), "give one"),
        (("--sweep-concurrency", "64-128"), "START:STOP:STEP"),
        (("--sweep-concurrency", "128:64:8"), "STOP >= START"),
        (("--sweep-concurrency", "1:100000:1"), "at most 1,000"),
        (("--experts-per-rank", "0"), "--experts-per-rank must be > 0"),
    ],
)
def test_bad_concurrency_exits_2_with_a_message(args, message):
    proc = sim(*PLUGIN, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_sweep_signs_where_a_fixed_step_cost_sets_them():
    """A 10 s per-step overhead makes every step ~10 s: at a fixed concurrency per-chip output
    is then N / (chips x 10 s), so 16 + 16 (32 chips) gives twice EP64's and 64 + 16 (80 chips)
    a fifth less, at every concurrency that fits (16 attention chips hold 77 x 16 sequences)."""
    args = ("--overhead-ms", "10000", "--layouts", "16:16,64:16", "--baseline", "64")
    data = sim_json(*args, "--sweep-concurrency", "64:1280:64")
    grid = list(range(64, 1281, 64))
    assert data["signs"]["16A+16F"] == {"faster": grid[:-1], "slower": []}
    assert data["signs"]["64A+16F"] == {"faster": [], "slower": grid[:-1]}
    last = data["points"][-1]
    assert last["skipped"] and "16A+16F's 16 attention chips hold 77 sequences" in last["skipped"]
    for point in data["points"][:-1]:
        assert point["layouts"]["16A+16F"]["vs_baseline"] == pytest.approx(1.0, abs=0.01)
        assert point["layouts"]["64A+16F"]["vs_baseline"] == pytest.approx(-0.2, abs=0.01)
    table = sim(*args, "--sweep-concurrency", "64:1280:64")
    assert "16A+16F vs EP64: faster at 64-1,216; slower at none" in table.stdout
    assert "not run at 1,280" in table.stdout


def test_deepep_ascend_latency_is_the_measured_time_beyond_the_bytes():
    ep16 = next(p for p in ASCEND_LOW_LATENCY if p.ranks == 16)
    fixed = ascend_fixed_latency(ep16)
    assert fixed.dispatch_s == pytest.approx(139e-6 - 128 * 8 * 7168 / 107e9)  # 70 us
    assert fixed.combine_s == 0.0  # 135 us is its bytes at 103 GB/s
    assert all_to_all_latency_s(16, "ascend") == pytest.approx((fixed.dispatch_s, 20e-6))
    assert all_to_all_latency_s(64, "ascend") == all_to_all_latency_s(32, "ascend")  # held


def test_the_recipe_settings_give_64_16_ahead_and_48_16_ahead_too():
    """At the recipe's per-die batches (EP64 16, attention 28 at 16k) the FFN dies see the
    recipe's 168 and 224 tokens per expert and keep headroom; 64 + 16 is ahead of EP64 as
    published, 48 + 16 ahead as well (published 5.3% behind). Both cannot hold with 64 + 16's
    step the longer: per die 64 + 16 <= 48 + 16 x (64/80) / (48/64)."""
    data = sim_json(*RECIPE, "--ep-batch", "16", "--batch", "28")
    base, rows = data["baseline"], {r["layout"]: r for r in data["layouts"]}
    assert base["batch_per_attention_chip"] == 16 and base["bound"] == "compute + all-to-all"
    assert base["all_to_all_latency_s"]["dispatch_s"] > 80e-6
    low, high = rows["48A+16F"], rows["64A+16F"]
    assert (low["tokens_per_expert"], high["tokens_per_expert"]) == (168, 224)
    assert low["batch_per_attention_chip"] == high["batch_per_attention_chip"] == 28
    assert high["ffn_busy"] < 0.8 and high["vs_baseline"] > 0 and low["vs_baseline"] > 0
    assert high["step_s"] >= low["step_s"]
    assert high["tokens_per_s_per_chip"] <= low["tokens_per_s_per_chip"] * (64 / 80) / (48 / 64)
