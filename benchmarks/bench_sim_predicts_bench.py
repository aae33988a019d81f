"""The calibrated simulator against `splitserve bench`: predict each load level of a saved
bench run (same arrival stream: bench and sim draw it from the same seed) and print the
prediction next to the measurement: TTFT p50, ITL p50 and p99, attainment of each SLO,
and the DistServe goodput. The peer is the real server, measured in that bench run.

    splitserve sim calibrate --engine URL --model DIR --gpu host.json --fit-per-seq \\
        --fit-small-chunk --fit-kv-bandwidth --json > fit.json
    splitserve bench --url URL --tokenizer DIR --rate 2,5,10 --num-requests 60 --json run.json
    python benchmarks/bench_sim_predicts_bench.py run.json fit.json DIR host.json [--replicas 1]
    python benchmarks/bench_sim_predicts_bench.py up.json fit.json DIR host.json --pd 1:1

The server is modelled as `serve` runs (one collocated engine) or, with `--pd P:D`, as `up`
runs (P prefill and D decode engines, KV pushed layer by layer over the host's memory):
splitserve's default token budget, several prompts per step, the fitted step costs (one
roofline per step, as fitted). What the client adds on top of the engines (HTTP, render,
detokenize, the proxy's hops) is not modelled.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from splitserve.config import SchedulerConfig
from splitserve.goodput import SLO, distserve_goodput
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
from splitserve.sim.workload import synthetic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bench_json")
    p.add_argument("fit_json")
    p.add_argument("model")
    p.add_argument("gpu")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--budget", type=int, default=SchedulerConfig().max_num_batched_tokens)
    p.add_argument("--pd", default=None, metavar="P:D", help="model `splitserve up` with P prefill, D decode")
    args = p.parse_args()
    with open(args.bench_json) as f:
        run = json.load(f)
    with open(args.fit_json) as f:
        fit = json.load(f)
    eff = Efficiency(
        compute=fit["compute"],
        bandwidth=fit["bandwidth"],
        overhead_s=fit["overhead_s"],
        attention=fit["attention"],
        per_seq_overhead_s=fit["per_seq_overhead_s"],
        small_chunk_tokens=fit["small_chunk_tokens"],
        kv_bandwidth=fit["kv_bandwidth"],
    )
    sched = InstanceConfig(SchedulerConfig(max_num_batched_tokens=args.budget))
    dep = Deployment(
        load_model(args.model),
        load_gpu(args.gpu),
        replicas=args.replicas,
        eff=eff,
        sched=sched,
        prefill_sched=sched,
        routing="least_loaded",
    )
    if args.pd:
        prefills, decodes = (int(x) for x in args.pd.split(":"))
        gpu = dep.gpu  # KV moves through shared memory: the host's copy bandwidth
        link = KVLink(gbps=gpu.mem_bw * 8 / 1e9)
        dep = replace(dep, mode="pd", prefill_instances=prefills, decode_instances=decodes, link=link)
    slos = [SLO.parse(s) for s in run["slos"]]
    rows, errors = [], []
    att_pred: dict[str, list[float]] = {s.name: [] for s in slos}
    for level in run["levels"]:
        load, reqs = level["load"], level["requests"]
        n = len(reqs)
        prompt = round(float(np.mean([r["input_tokens"] for r in reqs if not r["warmup"]])))
        output = round(float(np.mean([r["output_tokens"] for r in reqs if not r["warmup"]])))
        wl: Workload = synthetic(load["rate"], n, prompt, output, seed=load["seed"])
        r = simulate(dep, wl)
        keep = np.arange(n) >= load["warmup"]
        itl = np.concatenate([g for g, k in zip(r.gaps, keep, strict=True) if k and len(g)])
        s = level["summary"]
        pairs = {
            "TTFT p50 ms": (float(np.median(r.ttft[keep])) * 1e3, s["ttft"]["p50"] * 1e3),
            "ITL p50 ms": (float(np.percentile(itl, 50)) * 1e3, s["itl"]["p50"] * 1e3),
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
        rows.append(
            f"goodput {slo.name:28s} sim {pred:g} req/s  bench {run['goodput_distserve'][slo.name]:g} req/s"
        )
    print("\n".join(rows))
    within = sum(e <= 0.10 for e in errors)
    median = np.median(errors)
    print(f"predictions within 10% (measured non-zero): {within}/{len(errors)}; median |error| {median:.1%}")


if __name__ == "__main__":
    main()
