"""`splitserve sim` commands for the closed-form analyses (kv, roofline, scenario,
multiturn, tp, cuts) and calibration."""

from __future__ import annotations

import argparse
import json

from splitserve.sim import analysis, calibrate
from splitserve.sim.cmd_common import efficiency, emit, progress, require_positive
from splitserve.sim.cmd_profile import write_profile
from splitserve.sim.kv import kv_report, required_gbps
from splitserve.sim.roofline import Efficiency, Roofline
from splitserve.sim.specs import load_gpu, load_model


def cmd_kv(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    require_positive(tokens=args.tokens, tp=args.tp)
    links = args.link_gbps or [400.0]
    require_positive(link_gbps=min(links))
    rl = Roofline(model, gpu, efficiency(args), tp=args.tp)
    prefill_s = rl.step_s(rl.prefill(args.tokens)) - rl.eff.overhead_s
    # the seed's estimate: 2 FLOPs per parameter per token, no attention, no all-reduce
    seed_prefill_s = 2 * model.total_params * args.tokens / (args.tp * gpu.peak_flops * args.eff_compute)
    achieved = gpu.peak_flops * args.eff_compute * args.tp
    reports = [kv_report(model, args.tokens, g, prefill_s)._asdict() for g in links]
    need = required_gbps(model, achieved)
    per = model.kv_bytes_per_token
    lines = [
        (
            f"{model.name}: {per / 1024:.0f} KiB per token (MLA: a {model.kv_lora_rank}-wide latent "
            f"+ a {model.qk_rope_dim}-wide rope key per layer)"
            if model.is_mla
            else f"{model.name}: {per / 1024:.0f} KiB per token with {model.kv_heads} KV heads (would be "
            f"{model.mha_kv_bytes_per_token / 1024:.0f} KiB with full multi-head attention, "
            f"{model.heads // model.kv_heads}x more)"
        ),
        f"{args.tokens:,}-token prompt: {per * args.tokens / 1e9:.2f} GB "
        f"({per * args.tokens / 1e6:.0f} MB) of KV"
        + (
            f" + {model.state_bytes_per_request / 2**20:.1f} MiB of Mamba state ({model.mamba_layers} "
            "layers, handed over whole)"
            if model.state_bytes_per_request
            else ""
        ),
        f"prefill on {args.tp}x {gpu.name} at {args.eff_compute:.0%} of peak: {prefill_s * 1e3:.0f} ms "
        f"(2 FLOPs/parameter only: {seed_prefill_s * 1e3:.0f} ms); KV produced at {need:.1f} Gb/s",
        f"{'link':>12s} {'sent after prefill':>19s} {'streamed layer by layer':>24s}",
    ]
    for r in reports:
        lines.append(
            f"{r['link_gbps']:>8g} Gb/s {r['bulk_transfer_s'] * 1e3:16.1f} ms "
            f"{r['layerwise_exposed_s'] * 1e3:21.1f} ms"
        )
    data = {
        "model": model.name,
        "kv_bytes_per_token": per,
        "mha_kv_bytes_per_token": model.mha_kv_bytes_per_token,
        "tokens": args.tokens,
        "request_bytes": model.cache_bytes(args.tokens),
        "state_bytes": model.state_bytes_per_request,
        "prefill_s": prefill_s,
        "seed_model_prefill_s": seed_prefill_s,
        "required_gbps": need,
        "links": reports,
    }
    return emit(args, data, lines)


def cmd_roofline(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    rl = Roofline(model, gpu, efficiency(args), tp=args.tp)
    rows = [
        ("prefill, 8,192-token prompt", rl.prefill(8192)),
        ("prefill chunk, 2,048 tokens", rl.prefill(2048, past=3072)),
        ("decode step, 1 stream @ 8k ctx", rl.decode(1, 8192)),
        ("decode step, 2 streams @ 8k ctx", rl.decode(2, 2 * 8192)),
        ("decode step, 64 streams @ 1k ctx", rl.decode(64, 64 * 1024)),
    ]
    for n in args.prefill or []:
        require_positive(prefill=n)
        rows.append((f"prefill, {n:,} tokens after {args.past:,}", rl.prefill(n, past=args.past)))
    for b in args.decode or []:
        require_positive(decode=b)
        rows.append((f"decode step, {b} streams @ {args.context:,} ctx", rl.decode(b, b * args.context)))
    out = [
        {
            "workload": name,
            "flops": c.flops,
            "bytes": c.bytes,
            "intensity": c.intensity,
            "bound": rl.bound(c),
            "ideal_s": rl.ideal_s(c),
            "expected_s": rl.step_s(c),
        }
        for name, c in rows
    ]
    lines = [
        f"{model.name}: {model.layer_params / 1e9:.2f}B layer params + "
        f"{model.head_params / 1e9:.2f}B output head",
        f"{gpu.name} ridge point: {gpu.ridge:.0f} FLOPs per byte",
    ]
    if model.is_hybrid:
        lines.append(
            f"hybrid: {model.attention_layers} attention layers "
            f"({model.kv_bytes_per_token / 1024:.0f} KiB of KV per token), {model.mamba_layers} Mamba "
            f"layers ({model.state_bytes_per_request / 2**20:.1f} MiB of state per sequence, read and "
            "written every decode step)"
        )
    lines += [
        "",
        f"{'workload':34s} {'FLOPs/byte':>10s} {'bound by':>9s} {'ideal time':>11s} {'expected':>10s}",
    ]
    for r in out:
        lines.append(
            f"{r['workload']:34s} {r['intensity']:10.0f} {r['bound']:>9s} {r['ideal_s'] * 1e3:9.1f} ms"
            f" {r['expected_s'] * 1e3:7.1f} ms"
        )
    data = {
        "model": model.name,
        "gpu": gpu.name,
        "layer_params": model.layer_params,
        "head_params": model.head_params,
        "ridge": gpu.ridge,
        "state_bytes_per_request": model.state_bytes_per_request,
        "rows": out,
    }
    return emit(args, data, lines)


def cmd_scenario(args: argparse.Namespace) -> int:
    rl = Roofline(load_model(args.model), load_gpu(args.gpu), efficiency(args))
    require_positive(prompt_tokens=args.prompt_tokens)
    cases = [
        ("shared worker, whole prompt", {}),
        ("shared worker, chunked (2,048)", {"chunk": 2048}),
        ("shared worker, chunked (512)", {"chunk": 512}),
        ("disaggregated, 20 ms transfer", {"transfer_s": 0.02}),
        ("disaggregated, 1.3 s transfer", {"transfer_s": 1.3}),
    ]
    rows = [{"case": name, **analysis.two_streams(rl, prompt=args.prompt_tokens, **kw)} for name, kw in cases]
    lines = [
        f"{r['case']:34s} N's first token after {r['n_ttft_s'] * 1e3:6.0f} ms | "
        f"A/B worst stall {r['ab_worst_stall_s'] * 1e3:5.0f} ms"
        for r in rows
    ]
    return emit(args, rows, lines)


def cmd_multiturn(args: argparse.Namespace) -> int:
    rl = Roofline(load_model(args.model), load_gpu(args.gpu), efficiency(args))
    require_positive(
        turns=args.turns, first_prompt=args.first_prompt, message=args.message, answer=args.answer
    )
    rows = analysis.multiturn(rl, args.first_prompt, args.answer, args.message, args.turns)
    lines = [
        f"{'turn':>4s} {'history':>8s} | {'collocated + prefix cache':>26s} | {'P/D one-way':>18s} | "
        f"{'P/D bidirectional':>30s}"
    ]
    for r in rows:
        lines.append(
            f"{r['turn']:4d} {r['history']:8,d} | {r['new_tokens']:>6,d} new -> "
            f"{r['collocated_s'] * 1e3:5.0f} ms     | {r['one_way_tokens']:>5,d} -> "
            f"{r['one_way_s'] * 1e3:5.0f} ms | {r['new_tokens']:>5,d} -> {r['bidirectional_s'] * 1e3:5.0f}"
            f" ms + pull {r['pull_bytes'] / 2**20:3.0f} MiB"
        )
    return emit(args, rows, lines)


def cmd_tp(args: argparse.Namespace) -> int:
    model, gpu, eff = load_model(args.model), load_gpu(args.gpu), efficiency(args)
    require_positive(prompt_tokens=args.prompt_tokens, context=args.context, itl_ms=args.itl_ms)
    pre = [analysis.prefill_pool(model, gpu, eff, args.prompt_tokens, tp) for tp in args.tps]
    dec = [analysis.decode_pool(model, gpu, eff, tp, args.context, args.itl_ms / 1e3) for tp in args.tps]
    lines = [f"Prefill pool: TTFT for one {args.prompt_tokens:,}-token prompt (roofline | seed's model)"]
    lines += [
        f"  TP={r['tp']}: {r['ttft_s'] * 1e3:5.0f} ms | {r['seed_model_ttft_s'] * 1e3:5.0f} ms" for r in pre
    ]
    lines += [
        f"Decode pool: largest batch at {args.context:,} context with ITL <= {args.itl_ms:g} ms",
        f"  {'layout':8s} {'batch':>6s} {'ITL':>8s} {'tok/s/GPU':>10s} {'seed ITL':>9s} "
        f"{'seed tok/s/GPU':>15s}  limited by",
    ]
    for r in dec:
        lines.append(
            f"  TP={r['tp']:<5d} {r['batch']:6d} {r['itl_s'] * 1e3:6.1f} ms "
            f"{r['tokens_per_s_per_gpu']:10,.0f}"
            f" {r['seed_model_itl_s'] * 1e3:6.1f} ms {r['seed_model_tokens_per_s_per_gpu']:15,.0f}"
            f"  {r['limited_by']}"
        )
    return emit(args, {"prefill": pre, "decode": dec}, lines)


def cmd_cuts(args: argparse.Namespace) -> int:
    lm, moe = load_model(args.model), load_model(args.moe_model)
    if not moe.is_moe:
        raise ValueError(f"--moe-model {moe.name} is not a mixture-of-experts model")
    c = analysis.cut_points(lm, moe)
    ssm = analysis.mamba_break_even(load_model(args.hybrid_model), args.hybrid_tp)
    mib = 2**20
    lines = [
        "Cut 1: encoder | prefill",
        f"  {c['embedding_bytes_per_token'] / 1024:.0f} KiB/token; {c['vision_tokens']} visual tokens -> "
        f"{c['images_embedding_bytes'] / mib:.1f} MiB (their KV cache: {c['images_kv_bytes'] / mib:.0f} MiB)",
        f"Cut 2: prefill | decode: {c['kv_bytes_per_token'] / 1024:.0f} KiB/token ({lm.name}), "
        "once per request",
        f"Cut 3: attention | FFN ({moe.name}): {c['af_bytes_per_token_per_pass'] / mib:.2f} MiB "
        "per token per "
        f"pass vs {c['moe_kv_bytes_per_token'] / 1024:.0f} KiB of KV: {c['af_over_kv']:.0f}x, every step",
        "  tokens per expert per step: "
        + ", ".join(f"{k}: {v:.0f}" for k, v in c["tokens_per_expert"].items()),
        f"Hybrid SSM ({ssm['model']}, per GPU at TP={ssm['tp']}, per layer, per request): state "
        f"{ssm['state_bytes'] / mib:.2f} MiB, fixed, vs {ssm['kv_bytes_per_token_layer'] / 1024:.3g} KiB "
        f"of attention KV per token: break-even {ssm['break_even_tokens']:,.0f} prompt tokens",
        f"  a request hands over ({ssm['attention_layers']} attention layers' KV + "
        f"{ssm['mamba_layers']} Mamba layers' state, per GPU): "
        + ", ".join(
            f"{h['prompt_tokens']:,} tokens -> {h['kv_bytes'] / mib:.1f} + {h['state_bytes'] / mib:.1f} MiB"
            for h in ssm["handoff_per_gpu"]
        ),
    ]
    return emit(args, {**c, "ssm": ssm}, lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    model, gpu = load_model(args.model), load_gpu(args.gpu)
    rl = Roofline(model, gpu, efficiency(args), tp=args.tp)
    if args.synthetic:
        try:
            values = [float(x) for x in args.synthetic.split(",")]
            c, b, o = values[:3]
            attn = values[3] if len(values) > 3 else None
            per_seq = values[4] / 1e3 if len(values) > 4 else 0.0
            small = values[5] if len(values) > 5 else 0.0
            if len(values) > 6:
                raise ValueError
        except ValueError as exc:
            raise ValueError(
                "--synthetic takes COMPUTE,BANDWIDTH,OVERHEAD_MS[,ATTENTION,PER_SEQ_MS,SMALL_CHUNK_TOKENS]"
            ) from exc
        samples = calibrate.synthetic_samples(rl, Efficiency(c, b, o / 1e3, attn, per_seq, small))
        doc = {"model": model.name, "gpu": gpu.name, "samples": calibrate.samples_to_json(samples)}
        print(json.dumps(doc))
        return 0
    if args.engine:
        if args.input:
            raise ValueError("give a JSON file of step times or --engine URL, not both")
        from splitserve.sim.engine_probe import EngineProbe, measure

        if len(args.engine) > 1 and not args.out:
            raise ValueError("several --engine URLs make one profile: give --out FILE")
        probes = [EngineProbe(url) for url in args.engine]
        thread_counts = [probe.threads() for probe in probes]
        if len(set(thread_counts)) < len(probes):
            raise ValueError(
                f"each --engine must run on a different number of threads (they run on {thread_counts})"
            )
        measured: list[tuple[int, list[calibrate.Sample]]] = []
        for url, probe, count in zip(args.engine, probes, thread_counts, strict=True):
            # one at a time: each probe's steps alone on the machine
            with progress(
                args,
                len(args.probe_prefill) + len(args.probe_batches) * len(args.probe_contexts),
                f"probing the engine at {url}",
            ) as tick:
                found = measure(
                    probe,
                    args.probe_prefill,
                    args.probe_batches,
                    args.probe_contexts,
                    repeats=args.repeats,
                    tick=tick,
                )
            measured.append((count, found))
        threads, samples = measured[0]
        api_s = probes[0].api_latency_s(repeats=args.repeats) if args.out else None  # a profile's figure
        if args.save:
            doc = {"model": model.name, "gpu": gpu.name, "samples": calibrate.samples_to_json(samples)}
            with open(args.save, "w") as f:
                json.dump(doc, f, indent=1)
    elif not args.input:
        raise ValueError(
            "give a JSON file of measured step times, --engine URL, or --synthetic C,B,OVERHEAD_MS"
        )
    else:
        samples, _ = calibrate.load_samples(args.input)
    if args.out:
        if not args.engine:
            return write_profile(args, model, gpu, samples)
        return write_profile(args, model, gpu, samples, threads, dict(measured[1:]), api_s)
    res = calibrate.fit(
        rl,
        samples,
        attention=args.fit_attention,
        per_seq=args.fit_per_seq,
        small_chunk=args.fit_small_chunk,
        kv_bandwidth=args.fit_kv_bandwidth,
    )
    data = {
        "compute": res.eff.compute,
        "bandwidth": res.eff.bandwidth,
        "overhead_s": res.eff.overhead_s,
        "attention": res.eff.attention,
        "per_seq_overhead_s": res.eff.per_seq_overhead_s,
        "small_chunk_tokens": res.eff.small_chunk_tokens,
        "kv_bandwidth": res.eff.kv_bandwidth,
        "samples": res.samples,
        "compute_bound_samples": res.compute_bound,
        "rms_rel_error": res.rms_rel_error,
        "max_rel_error": res.max_rel_error,
    }
    lines = [
        f"{model.name} on {args.tp}x {gpu.name}: {res.samples} samples ({res.compute_bound} compute-bound)",
        f"  compute efficiency   {res.eff.compute:.3f}  (--eff-compute)",
        f"  bandwidth efficiency {res.eff.bandwidth:.3f}  (--eff-bandwidth)",
        f"  overhead per step    {res.eff.overhead_s * 1e3:.2f} ms  (--overhead-ms)",
    ]
    if res.eff.attention is not None:
        lines.append(f"  attention efficiency {res.eff.attention:.3f}  (--eff-attention)")
    if args.fit_per_seq:
        lines.append(
            f"  per sequence         {res.eff.per_seq_overhead_s * 1e3:.3f} ms  (--per-seq-overhead-ms)"
        )
    if res.eff.kv_bandwidth is not None:
        lines.append(f"  KV read bandwidth    {res.eff.kv_bandwidth:.3f}  (--eff-kv-bandwidth)")
    if args.fit_small_chunk:
        lines.append(f"  small-chunk tokens   {res.eff.small_chunk_tokens:.0f}  (--small-chunk-tokens)")
    lines.append(f"  fit error: rms {res.rms_rel_error:.1%}, max {res.max_rel_error:.1%}")
    return emit(args, data, lines)
