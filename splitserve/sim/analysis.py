"""Closed-form analyses of the seed: the two-streams scenario, multi-turn prefill work,
tensor-parallel pool sizing, and what crosses each cut through a model.
Each returns plain rows (dicts) that the CLI prints or dumps as JSON."""

from __future__ import annotations

import itertools

import numpy as np

from splitserve.sim.kv import kv_bytes
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.specs import GPUSpec, ModelSpec


def two_streams(
    rl: Roofline,
    prompt: int = 8192,
    arrive_s: float = 0.10,
    horizon_s: float = 2.6,
    context: int = 2048,
    chunk: int | None = None,
    transfer_s: float | None = None,
) -> dict:
    """Streams A and B are mid-answer (`context` tokens each) when prompt N arrives.
    Shared GPU: N's prompt rides in A and B's decode steps, whole (`chunk=None`) or chunked.
    Disaggregated (`transfer_s` given): N prefills elsewhere and joins after the transfer."""
    t, done, a_times, n_times = 0.0, 0, [], []
    n_ready = None
    if transfer_s is not None:
        n_ready = arrive_s + rl.step_s(rl.prefill(prompt)) + transfer_s
    while t < horizon_s:
        if n_ready is not None:
            joined = t >= n_ready
            streams = 2 + int(joined)
            t += rl.step_s(rl.decode(streams, streams * context))
            if joined:
                n_times.append(t)
        else:
            streams = 2 + int(bool(n_times))
            cost = rl.decode(streams, streams * context)
            if t >= arrive_s and done < prompt:
                n = prompt - done if chunk is None else min(chunk, prompt - done)
                cost = cost + rl.prefill(n, past=done)
                done += n
            t += rl.step_s(cost)
            if n_times or done >= prompt:
                n_times.append(t)
        a_times.append(t)
    gaps = [b - a for a, b in itertools.pairwise(a_times)]
    return {
        "design": "disaggregated" if transfer_s is not None else "shared",
        "chunk": chunk,
        "transfer_s": transfer_s,
        "n_ttft_s": n_times[0] - arrive_s if n_times else None,
        "ab_worst_stall_s": max(gaps),
    }


def multiturn(
    rl: Roofline, first_prompt: int = 4000, answer: int = 600, message: int = 400, turns: int = 6
) -> list[dict]:
    """Prefill work per turn: collocated with a prefix cache, one-way P/D (prefill recomputes
    the last answer, which decode generated) and bidirectional P/D (prefill pulls it back)."""
    rows, history = [], 0
    for turn in range(1, turns + 1):
        new = first_prompt if turn == 1 else message
        redo = 0 if turn == 1 else answer
        rows.append(
            {
                "turn": turn,
                "history": history,
                "new_tokens": new,
                "collocated_s": rl.step_s(rl.prefill(new, past=history)),
                "one_way_tokens": new + redo,
                "one_way_s": rl.step_s(rl.prefill(new + redo, past=history - redo)),
                "bidirectional_s": rl.step_s(rl.prefill(new, past=history)),
                "pull_bytes": kv_bytes(rl.model, redo),
            }
        )
        history += new + answer
    return rows


def prefill_pool(model: ModelSpec, gpu: GPUSpec, eff: Efficiency, tokens: int, tp: int) -> dict:
    """Prefill pool: TTFT of one prompt on a TP instance (roofline + all-reduces), and the
    seed's simpler model (2 FLOPs per parameter per token, no attention)."""
    rl = Roofline(model, gpu, eff, tp=tp)
    cost = rl.prefill(tokens)
    linear_only = 2 * model.total_params * tokens / (tp * gpu.peak_flops * eff.compute)
    comm = rl.comm_s(tokens) - 2 * model.layers * 15e-6 * (tp > 1)
    return {
        "tp": tp,
        "ttft_s": rl.step_s(cost) - eff.overhead_s,
        "seed_model_ttft_s": linear_only + comm,
        "allreduce_s": rl.comm_s(tokens),
    }


def decode_pool(
    model: ModelSpec,
    gpu: GPUSpec,
    eff: Efficiency,
    tp: int,
    context: int = 4096,
    itl_slo_s: float = 0.040,
    mem_util: float = 0.9,
) -> dict:
    """Decode pool: the largest batch per instance at `context` tokens under the ITL target,
    capped by KV memory; its ITL and output tokens/s per GPU."""
    rl = Roofline(model, gpu, eff, tp=tp)
    mem_cap = rl.max_sequences(context, mem_util)  # KV, and a hybrid's Mamba state slots

    def itl(batch: int) -> float:
        return float(rl.decode_times(batch, np.array([float(batch * context)]))[0]) - eff.overhead_s

    lo, hi = 0, 1 << 20
    while lo < hi:  # the largest batch whose step fits the ITL target (ITL grows with batch)
        mid = (lo + hi + 1) // 2
        if itl(mid) <= itl_slo_s:
            lo = mid
        else:
            hi = mid - 1
    batch = int(min(mem_cap, lo))
    step = itl(batch)
    # the seed's simpler model: all weights (embedding included) and the KV over HBM, plus a
    # fixed all-reduce latency, no all-reduce volume
    bw = gpu.mem_bw * eff.bandwidth
    seed_itl = (model.weight_bytes / tp + batch * context * model.kv_bytes_per_token / tp) / bw
    seed_itl += 2 * model.layers * 15e-6
    return {
        "tp": tp,
        "batch": batch,
        "itl_s": step,
        "tokens_per_s_per_gpu": batch / step / tp if batch else 0.0,
        "limited_by": "memory" if mem_cap < lo else "ITL target",
        "memory_cap": int(mem_cap),
        "itl_cap": lo,
        "seed_model_itl_s": seed_itl,
        "seed_model_tokens_per_s_per_gpu": batch / seed_itl / tp if batch else 0.0,
    }


def cut_points(
    lm: ModelSpec, moe: ModelSpec, images: int = 4, image_px: int = 640, px_per_token: int = 32
) -> dict:
    """What crosses each cut: embeddings (encoder | prefill), the KV cache (prefill | decode),
    hidden states at every MoE layer (attention | FFN)."""
    vis_tokens = images * (image_px // px_per_token) ** 2
    emb_per_token = lm.hidden * lm.dtype_bytes
    af_per_token = 2 * moe.hidden * moe.dtype_bytes * moe.moe_layers
    per_expert = {
        f"{ranks}x{batch}": ranks * batch * moe.experts_per_token / moe.experts
        for ranks in (48, 64)
        for batch in (32, 128)
    }
    return {
        "embedding_bytes_per_token": emb_per_token,
        "vision_tokens": vis_tokens,
        "images_embedding_bytes": vis_tokens * emb_per_token,
        "images_kv_bytes": vis_tokens * lm.kv_bytes_per_token,
        "kv_bytes_per_token": lm.kv_bytes_per_token,
        "af_bytes_per_token_per_pass": af_per_token,
        "moe_kv_bytes_per_token": moe.kv_bytes_per_token,
        "af_over_kv": af_per_token / moe.kv_bytes_per_token,
        "tokens_per_expert": per_expert,
    }


def mamba_break_even(model: ModelSpec, tp: int = 2, prompts: tuple[int, ...] = (1024, 8192, 65536)) -> dict:
    """A hybrid model's Mamba layer state (fp32 SSM state + conv state, per GPU at `tp`, per
    request) against one attention layer's per-token KV: beyond how many prompt tokens the
    state is the smaller thing to ship; and what a whole request hands over at a few prompt
    lengths (every attention layer's KV, every Mamba layer's state)."""
    if model.mamba is None:
        raise ValueError(f"{model.name} has no Mamba layers (a hybrid model, e.g. Nemotron-3-Nano-30B-A3B)")
    if tp < 1:
        raise ValueError("--hybrid-tp must be >= 1")
    state = model.mamba_state_bytes_per_layer(tp)
    kv_layer = model.kv_bytes_per_token_layer(tp)
    handoff = [
        {
            "prompt_tokens": n,
            "kv_bytes": model.attention_layers * n * kv_layer,
            "state_bytes": model.mamba_layers * state,
        }
        for n in prompts
    ]
    return {
        "model": model.name,
        "tp": tp,
        "mamba_layers": model.mamba_layers,
        "attention_layers": model.attention_layers,
        "ssm_state_bytes": model.mamba.ssm_state_bytes(tp),
        "conv_state_bytes": model.mamba.conv_state_bytes(model.dtype_bytes, tp),
        "state_bytes": state,
        "kv_bytes_per_token_layer": kv_layer,
        "break_even_tokens": state / kv_layer,
        "handoff_per_gpu": handoff,
    }
