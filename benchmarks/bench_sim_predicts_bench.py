"""The calibrated simulator against `splitserve bench`: predict each load level of a saved
bench run (same arrival stream: bench and sim draw it from the same seed; each request's
own prompt and output lengths, as bench recorded them) and print every figure's prediction
next to its measurement: TTFT p50 and p90, ITL p50, p90 and p99, attainment of each SLO,
and the DistServe goodput; last, how many are within 10%. The peer is the real server,
measured in that bench run.

    splitserve sim calibrate --engine URL --render RENDER_URL --model DIR --gpu host.json \\
        --out profile.json
    splitserve bench --url URL --tokenizer DIR --rate 2,5,10 --num-requests 60 --json run.json
    python benchmarks/bench_sim_predicts_bench.py run.json DIR host.json --profile profile.json
    python benchmarks/bench_sim_predicts_bench.py up.json DIR host.json --profile profile.json --pd 1:1

`--profile` (a `sim calibrate --out` file): the fitted step times, the render tier's cost
per request and token, and (with `--pd`) the P/D decision on the profile's costs, as the
proxy's `--pd-decision cost`. `--fit` (a `sim calibrate --json` roofline fit) instead: the
roofline at the fitted efficiencies, nothing around the engine. The server is modelled as
`serve` runs (one collocated engine) or, with `--pd P:D`, as `up` runs (P prefill and D
decode engines, KV pushed layer by layer over the host's memory): splitserve's default
token budget, several prompts per step, least-loaded routing.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from splitserve.config import SchedulerConfig
from splitserve.goodput import SLO, arrival_times, distserve_goodput
from splitserve.sim import (
    Deployment,
    Efficiency,
    InstanceConfig,
    KVLink,
    Workload,
    load_gpu,
    load_model,
    simulate,
)
from splitserve.sim.metrics import met
from splitserve.sim.profile import load_profile


def deployment(args: argparse.Namespace) -> Deployment:
    sched = InstanceConfig(SchedulerConfig(max_num_batched_tokens=args.budget))
    dep = Deployment(
        load_model(args.model),
        load_gpu(args.gpu),
        replicas=args.replicas,
        sched=sched,
        prefill_sched=sched,
        routing="least_loaded",
    )
    if args.profile:
        profile = load_profile(args.profile)
        dep = replace(dep, steps=profile.steps, cpu=profile.cpu, pd_costs=profile.decision_costs())
    else:
        with open(args.fit) as f:
            fit = json.load(f)
        keys = ("compute", "bandwidth", "overhead_s", "attention", "per_seq_overhead_s")
        eff = Efficiency(
            **{k: fit[k] for k in keys},
            small_chunk_tokens=fit["small_chunk_tokens"],
            kv_bandwidth=fit["kv_bandwidth"],
        )
        dep = replace(dep, eff=eff)
    if args.pd:
        prefills, decodes = (int(x) for x in args.pd.split(":"))
        link = KVLink(
            gbps=dep.gpu.mem_bw * 8 / 1e9
        )  # KV moves through shared memory: the host's copy bandwidth
        dep = replace(dep, mode="pd", prefill_instances=prefills, decode_instances=decodes, link=link)
    return dep


def workload_of(level: dict) -> Workload:
    """The level's arrivals (bench's seeded stream) with each request's recorded lengths."""
    load, reqs = level["load"], sorted(level["requests"], key=lambda r: r["request_id"])
    n = len(reqs)
    arrival = arrival_times(
        load["rate"], n, load["seed"], load.get("arrival", "poisson"), load.get("burstiness", 1.0)
    )
    mean_in = round(float(np.mean([r["input_tokens"] for r in reqs if r["input_tokens"]])))
    prompts = [r["input_tokens"] or mean_in for r in reqs]
    outputs = [max(1, r["output_tokens"] or 1) for r in reqs]
    return Workload.open_loop(arrival, prompts, outputs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bench_json")
    p.add_argument("model")
    p.add_argument("gpu")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--profile", help="a `sim calibrate --engine URL --out FILE` profile")
    how.add_argument("--fit", help="a `sim calibrate --json` roofline fit")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--budget", type=int, default=SchedulerConfig().max_num_batched_tokens)
    p.add_argument("--pd", default=None, metavar="P:D", help="model `splitserve up` with P prefill, D decode")
    args = p.parse_args()
    with open(args.bench_json) as f:
        run = json.load(f)
    dep = deployment(args)
    slos = [SLO.parse(s) for s in run["slos"]]
    rows, errors = [], []
    att_pred: dict[str, list[float]] = {s.name: [] for s in slos}
    for level in run["levels"]:
        load = level["load"]
        r = simulate(dep, workload_of(level))
        keep = np.arange(len(r.ttft)) >= load["warmup"]
        itl = np.concatenate([g for g, k in zip(r.gaps, keep, strict=True) if k and len(g)])
        ttft, s = r.ttft[keep], level["summary"]
        pairs = {
            "TTFT p50 ms": (float(np.percentile(ttft, 50)) * 1e3, s["ttft"]["p50"] * 1e3),
            "TTFT p90 ms": (float(np.percentile(ttft, 90)) * 1e3, s["ttft"]["p90"] * 1e3),
            "ITL p50 ms": (float(np.percentile(itl, 50)) * 1e3, s["itl"]["p50"] * 1e3),
            "ITL p90 ms": (float(np.percentile(itl, 90)) * 1e3, s["itl"]["p90"] * 1e3),
            "ITL p99 ms": (float(np.percentile(itl, 99)) * 1e3, s["itl"]["p99"] * 1e3),
        }
        for slo in slos:
            a = float(met(slo, r)[keep].mean())
            att_pred[slo.name].append(a)
            pairs[f"attainment {slo.name} %"] = (a * 100, s["attainment"][slo.name] * 100)
        for name, (pred, meas) in pairs.items():
            err = pred / meas - 1 if meas else float("nan")
            if meas:
                errors.append(abs(err))
            rows.append(
                f"{load['rate']:>6g} req/s  {name:36s} sim {pred:9.1f}  bench {meas:9.1f}  {err:+7.1%}"
            )
    rates = [lv["load"]["rate"] for lv in run["levels"]]
    for slo in slos:
        pred = distserve_goodput(rates, att_pred[slo.name], run["required_attainment"])
        meas = run["goodput_distserve"][slo.name]
        if meas:
            errors.append(abs(pred / meas - 1))
        rows.append(f"goodput {slo.name:28s} sim {pred:g} req/s  bench {meas:g} req/s")
    print("\n".join(rows))
    within = sum(e <= 0.10 for e in errors)
    median = np.median(errors)
    print(f"predictions within 10% (measured non-zero): {within}/{len(errors)}; median |error| {median:.1%}")


if __name__ == "__main__":
    main()
