"""Every figure of the seed document next to splitserve's, with the error and the tolerance
it is held to (`splitserve sim reproduce`). Closed-form figures must match to the digit the
seed prints; simulated ones within the stated tolerance (the arrivals are the seed's own
stream, so they match within a few percent; `seed_tables` checks every cell)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from splitserve.goodput import SLO_AVERAGE, SLO_WORST_GAP
from splitserve.sim import analysis
from splitserve.sim.beyond import beyond_variants
from splitserve.sim.deployment import Deployment, KVLink
from splitserve.sim.kv import exposed_transfer_s, kv_bytes, transfer_s
from splitserve.sim.metrics import goodput
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.simulator import simulate
from splitserve.sim.specs import load_gpu, load_model
from splitserve.sim.workload import synthetic


class Figure(NamedTuple):
    name: str
    seed: float
    ours: float
    unit: str
    tolerance: float  # relative; 0: equal at the seed's printed precision
    digits: int  # decimals the seed prints
    command: str

    @property
    def error(self) -> float:
        return (self.ours - self.seed) / self.seed if self.seed else self.ours - self.seed

    @property
    def ok(self) -> bool:
        if self.tolerance == 0:
            return round(self.ours, self.digits) == round(self.seed, self.digits)
        return abs(self.error) <= self.tolerance


def closed_form() -> list[Figure]:
    qwen, llama, ds = load_model("Qwen2.5-7B"), load_model("Llama-3.1-70B"), load_model("DeepSeek-V3")
    rl = Roofline(qwen, load_gpu("L40S"))
    h100, e45 = load_gpu("H100-SXM"), Efficiency(compute=0.45)
    size = kv_bytes(qwen, 8192)
    rows = [
        ("KV per token, Llama-3.1-70B", 320, llama.kv_bytes_per_token / 1024, "KiB", 0, "sim kv"),
        (
            "KV per token, Qwen2.5-7B",
            56,
            qwen.kv_bytes_per_token / 1024,
            "KiB",
            0,
            "sim kv --model Qwen2.5-7B",
        ),
        ("10k-token Llama KV", 3.28, kv_bytes(llama, 10_000) / 1e9, "GB", 0, "sim kv"),
        ("8k-token Qwen KV", 470, size / 1e6, "MB", 0, "sim kv --model Qwen2.5-7B --tokens 8192"),
        (
            "8k Qwen KV over PCIe (200 Gb/s)",
            18.8,
            transfer_s(size, 200) * 1e3,
            "ms",
            0,
            "sim kv ... --link-gbps 200",
        ),
        ("L40S ridge point", 419, rl.ridge, "FLOPs/B", 0, "sim roofline"),
        ("8,192-token prefill, ideal", 332.5, rl.ideal_s(rl.prefill(8192)) * 1e3, "ms", 0, "sim roofline"),
        ("2,048-token chunk, ideal", 83.1, rl.ideal_s(rl.prefill(2048, 3072)) * 1e3, "ms", 0, "sim roofline"),
        (
            "decode, 64 streams @ 1k, ideal",
            20.7,
            rl.ideal_s(rl.decode(64, 65536)) * 1e3,
            "ms",
            0,
            "sim roofline",
        ),
    ]
    llama_kv = kv_bytes(llama, 10_000)
    prefill_s = 2 * 70.6e9 * 10_000 / (8 * 450e12)
    rows += [
        (
            "10k Llama KV sent after prefill",
            65.5,
            exposed_transfer_s(llama_kv, 80, 400, prefill_s, False) * 1e3,
            "ms",
            0,
            "sim kv",
        ),
        (
            "10k Llama KV streamed layer by layer",
            0.8,
            exposed_transfer_s(llama_kv, 80, 400, prefill_s, True) * 1e3,
            "ms",
            0,
            "sim kv",
        ),
    ]
    for label, kwargs, ttft, stall in [
        ("whole prompt", {}, 731, 710),
        ("chunked 2,048", {"chunk": 2048}, 737, 194),
        ("chunked 512", {"chunk": 512}, 763, 51),
        ("P/D 20 ms", {"transfer_s": 0.02}, 771, 24),
        ("P/D 1.3 s", {"transfer_s": 1.3}, 2053, 24),
    ]:
        r = analysis.two_streams(rl, **kwargs)
        rows.append((f"two streams, {label}: N's TTFT", ttft, r["n_ttft_s"] * 1e3, "ms", 0, "sim scenario"))
        rows.append(
            (f"two streams, {label}: A/B stall", stall, r["ab_worst_stall_s"] * 1e3, "ms", 0, "sim scenario")
        )
    turns = analysis.multiturn(rl)
    rows += [
        ("multi-turn turn 6, collocated", 41, turns[5]["collocated_s"] * 1e3, "ms", 0, "sim multiturn"),
        ("multi-turn turn 6, one-way P/D", 99, turns[5]["one_way_s"] * 1e3, "ms", 0, "sim multiturn"),
        ("multi-turn pull per turn", 33, turns[1]["pull_bytes"] / 2**20, "MiB", 0, "sim multiturn"),
        (
            "TP=4 prefill TTFT (seed's model)",
            721,
            analysis.prefill_pool(llama, h100, e45, 8192, 4)["seed_model_ttft_s"] * 1e3,
            "ms",
            0,
            "sim tp",
        ),
        (
            "TP=8 prefill TTFT (seed's model)",
            408,
            analysis.prefill_pool(llama, h100, e45, 8192, 8)["seed_model_ttft_s"] * 1e3,
            "ms",
            0,
            "sim tp",
        ),
        ("TP=4 decode batch", 109, analysis.decode_pool(llama, h100, e45, 4)["batch"], "seqs", 0, "sim tp"),
        (
            "TP=8 decode batch",
            323,
            analysis.decode_pool(llama, h100, e45, 8)["batch"],
            "seqs",
            0.005,
            "sim tp",
        ),
    ]
    cuts = analysis.cut_points(qwen, ds)
    ssm = analysis.mamba_break_even(load_model("Nemotron-3-Nano-seed"), tp=2)
    rows += [
        (
            "attention|FFN cut, DeepSeek-V3",
            1.59,
            cuts["af_bytes_per_token_per_pass"] / 2**20,
            "MiB/token",
            0,
            "sim cuts",
        ),
        ("... vs its KV cache", 24, cuts["af_over_kv"], "x", 0, "sim cuts"),
        ("Mamba state per layer, TP=2", 1.52, ssm["state_bytes"] / 2**20, "MiB", 0, "sim cuts"),
        ("attention KV per token per layer", 2, ssm["kv_bytes_per_token_layer"] / 1024, "KiB", 0, "sim cuts"),
        ("Mamba state break-even", 777, ssm["break_even_tokens"], "tokens", 0, "sim cuts"),
    ]
    return [Figure(n, s, o, u, t, _digits(s), c) for n, s, o, u, t, c in rows]


def _digits(x: float) -> int:
    text = f"{x}"
    return len(text.split(".")[1]) if "." in text and not text.endswith(".0") else 0


def simulated(seeds: int = 5, tick: Callable[[], None] | None = None) -> list[Figure]:
    model, gpu = load_model("Qwen2.5-7B"), load_gpu("L40S")
    col = Deployment(model, gpu)
    pd_slow = Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=1.3))
    pd_fast = Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=0.02))

    def make(rate: float, requests: int, seed: int):
        return synthetic(rate, requests, 8192, 256, seed=seed)

    def mean(dep: Deployment, rate: float, key: str) -> float:
        vals = []
        for s in range(seeds):
            vals.append(simulate(dep, make(rate, 100, s), seed=s).summary()[key])
            if tick:
                tick()
        return float(np.mean(vals))

    sim = "sim simulate"
    rows = [
        ("collocated p99 ITL @ 0.4 req/s", 174, mean(col, 0.4, "itl_p99_s") * 1e3, "ms", 0.06, sim),
        ("collocated p99 ITL @ 1.0 req/s", 194, mean(col, 1.0, "itl_p99_s") * 1e3, "ms", 0.02, sim),
        ("collocated median TTFT @ 0.2 req/s", 0.72, mean(col, 0.2, "ttft_median_s"), "s", 0.03, sim),
        ("P/D 1.3 s median TTFT @ 0.4 req/s", 2.05, mean(pd_slow, 0.4, "ttft_median_s"), "s", 0.03, sim),
        ("P/D 20 ms p99 ITL @ 0.6 req/s", 30, mean(pd_fast, 0.6, "itl_p99_s") * 1e3, "ms", 0.06, sim),
    ]
    budget512 = replace(col, sched=col.sched.with_budget(512))
    worst = np.mean([simulate(budget512, make(1.0, 100, s)).worst_gap.max() for s in range(seeds)])
    rows.append(("worst gap, 512-token budget @ 1.0 req/s", 51, worst * 1e3, "ms", 0.03, "sim sweep-chunk"))
    rates = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5]
    for name, dep, slo, seed_gp in [
        ("goodput, average SLO, collocated", col, SLO_AVERAGE, 0.2),
        ("goodput, average SLO, P/D 20 ms", pd_fast, SLO_AVERAGE, 0.6),
        ("goodput, worst-gap SLO, P/D 20 ms", pd_fast, SLO_WORST_GAP, 0.8),
    ]:
        gp = goodput(dep, make, slo, rates, seeds=seeds, tick=tick).goodput
        rows.append((name, seed_gp, gp, "req/s", 0.0, "sim goodput"))
    return [Figure(n, s, o, u, t, _digits(s), c) for n, s, o, u, t, c in rows]


def guide(seeds: int = 5) -> list[Figure]:
    """The guide's own measurements, against the simulator (not held to the seed's digits)."""
    model, gpu = load_model("Qwen2.5-7B"), load_gpu("L40S")
    col = Deployment(model, gpu)
    pd_slow = Deployment(model, gpu, mode="pd", link=KVLink(fixed_s=1.3))

    def mean(dep: Deployment, rate: float, key: str) -> float:
        return float(
            np.mean(
                [simulate(dep, synthetic(rate, 100, seed=s), seed=s).summary()[key] for s in range(seeds)]
            )
        )

    real = beyond_variants(col)[-1][1]  # the realistic preset
    real_pd = replace(real, mode="pd", link=KVLink(fixed_s=1.3))
    rows = [
        ("guide: collocated p99 ITL @ 0.4 req/s", 169, mean(col, 0.4, "itl_p99_s") * 1e3, "ms", 0.10, "seed"),
        ("guide: collocated median TTFT, low load", 0.7, mean(col, 0.2, "ttft_median_s"), "s", 0.06, "seed"),
        (
            "guide: median ITL 21-24 ms (mid 22.5)",
            22.5,
            mean(col, 0.2, "itl_p50_s") * 1e3,
            "ms",
            0.15,
            "seed",
        ),
        (
            "guide: P/D median TTFT, 1.3 s handoff",
            2.2,
            mean(pd_slow, 0.2, "ttft_median_s"),
            "s",
            0.10,
            "seed",
        ),
        (
            "guide, realistic: p99 ITL @ 0.4 req/s",
            169,
            mean(real, 0.4, "itl_p99_s") * 1e3,
            "ms",
            0.10,
            "realistic",
        ),
        (
            "guide, realistic: p99 ITL @ 2.0 req/s",
            263,
            mean(real, 2.0, "itl_p99_s") * 1e3,
            "ms",
            0.10,
            "realistic",
        ),
        (
            "guide, realistic: median TTFT, low load",
            0.7,
            mean(real, 0.2, "ttft_median_s"),
            "s",
            0.06,
            "realistic",
        ),
        (
            "guide, realistic: median ITL (mid 22.5)",
            22.5,
            mean(real, 0.2, "itl_p50_s") * 1e3,
            "ms",
            0.10,
            "realistic",
        ),
        (
            "guide, realistic: P/D TTFT, 1.3 s handoff",
            2.2,
            mean(real_pd, 0.2, "ttft_median_s"),
            "s",
            0.10,
            "realistic",
        ),
    ]
    return [Figure(n, s, o, u, t, 1, f"sim simulate --preset {p}") for n, s, o, u, t, p in rows]
