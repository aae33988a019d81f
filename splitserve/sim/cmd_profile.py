"""`sim calibrate ... --out FILE`: the engine profile from measured steps (and, with
`--render URL` / `--pd URL`, the tiers around the engine), for `--profile FILE` and the
proxy's `--pd-cost-profile FILE`; `sim retime`: a profile's steps re-timed from a live
engine's step log (retime.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from splitserve.bench.runner import read_json
from splitserve.protocol.step_record import read_step_log
from splitserve.sim.calibrate import CalibrationError, Sample
from splitserve.sim.cmd_common import emit
from splitserve.sim.path_latency import PathLatency, fit_path_latency, path_row
from splitserve.sim.profile import CpuCosts, build_profile, load_profile, save_profile
from splitserve.sim.retime import factor_rows, retime_profile
from splitserve.sim.specs import GPUSpec, ModelSpec
from splitserve.sim.step_model import fit_errors, fit_step_model
from splitserve.sim.step_waits import wait_rows


def write_profile(
    args: argparse.Namespace,
    model: ModelSpec,
    gpu: GPUSpec,
    samples: list[Sample],
    threads: int | None = None,
    other_samples: dict[int, list[Sample]] | None = None,
    api_s: float | None = None,
) -> int:
    """The profile of `samples` (measured on an engine of `threads`), the tiers `args`
    names, the step models of engines of other thread counts and, where the tiers are
    measured, the engine API's time per request beyond its steps (`api_s`)."""
    if (args.render or args.pd or args.proxy) and not args.engine:
        raise CalibrationError("--render, --proxy and --pd measure alongside --engine URL")
    cpu = handoff = None
    primary = fit_step_model(samples)
    other_steps = {k: fit_step_model(found) for k, found in (other_samples or {}).items()}
    # what the stack's own engines' steps take, where their thread counts were measured
    by_threads = {**other_steps, **({threads: primary} if threads else {})}
    if args.render:
        from splitserve.sim.tier_probe import measure_render

        cpu = measure_render(args.render, repeats=args.repeats)
    if args.proxy:
        from splitserve.sim.tier_probe import measure_tiers

        tiers = measure_tiers(args.proxy, by_threads, primary, cpu)
        shared, own = tiers.tiers, tiers.decode_engine
        cpu = replace(
            cpu or CpuCosts(),
            proxy_s_per_request=tiers.delay_s,
            cpu_s_per_request=shared.per_request,
            cpu_s_per_remote_request=shared.per_remote_request,
            cpu_s_per_step=shared.per_step,
            cpu_s_per_token=shared.per_token,
            engine_s_per_request=own.per_request,
            engine_s_per_remote_request=own.per_remote_request,
            prefill_engine_s_per_request=tiers.prefill_engine_s_per_request,
            engine_s_per_step=own.per_step,
            engine_s_per_token=own.per_token,
        )
    if cpu is not None and api_s is not None:
        cpu = replace(cpu, api_s_per_request=api_s)
    if args.pd:
        from splitserve.sim.tier_probe import measure_handoff

        handoff = measure_handoff(
            args.pd, by_threads, primary, model.kv_bytes_per_token, repeats=args.repeats
        )
    profile = build_profile(samples, model.name, gpu.name, cpu, handoff, model.kv_bytes_per_token)
    profile = replace(profile, threads=threads, other_steps=other_steps)
    save_profile(profile, args.out)
    rms, worst = fit_errors(profile.steps, samples)
    s = profile.steps
    lines = [
        f"{model.name}: {len(samples)} measured steps -> {args.out}",
        f"  prefill  {s.prefill_fixed_s * 1e3:.2f} ms + {s.prefill_s_per_token * 1e6:.2f} us/token "
        f"+ {s.prefill_s_per_pair * 1e9:.3f} ns per attended pair",
        "  decode   "
        + ", ".join(
            f"B={b}: {t * 1e3:.2f} ms" for b, t in zip(s.decode_batches, s.decode_base_s, strict=True)
        )
        + f" + {s.decode_s_per_context_token * 1e9:.1f} ns per context token",
        f"  a prompt beside decodes: + {s.mixed_fixed_s * 1e3:.2f} ms beyond its tokens",
        f"  fit error: rms {rms:.1%}, max {worst:.1%}"
        + (f" (an engine of {threads} threads)" if threads else ""),
        f"  P/D decision: prefill {profile.pd_costs['prefill_s_per_token'] * 1e6:.2f} us/token",
    ]
    for k, other in sorted(other_steps.items()):
        lines.append(
            f"  on {k} thread(s): prefill {other.prefill_fixed_s * 1e3:.2f} ms + "
            f"{other.prefill_s_per_token * 1e6:.2f} us/token; decode "
            + ", ".join(
                f"B={b}: {t * 1e3:.2f} ms"
                for b, t in zip(other.decode_batches, other.decode_base_s, strict=True)
            )
            + f"; beside decodes + {other.mixed_fixed_s * 1e3:.2f} ms"
        )
    if cpu is not None:
        lines.append(
            f"  render   {cpu.render_s_per_request * 1e3:.2f} ms/request"
            f" + {cpu.render_s_per_token * 1e6:.2f} us/token; "
            f"proxy {cpu.proxy_s_per_request * 1e3:.2f} ms/request; "
            f"the engine's API {cpu.api_s_per_request * 1e3:.2f} ms/request beyond its steps"
        )
        lines.append(
            f"  tiers' CPU {cpu.cpu_s_per_request * 1e3:.2f} ms/request"
            f" (+ {cpu.cpu_s_per_remote_request * 1e3:.2f} through a prefill worker)"
            f" + {cpu.cpu_s_per_step * 1e3:.3f} ms/step + {cpu.cpu_s_per_token * 1e3:.3f} ms/output token"
        )
        lines.append(
            f"  engines' own CPU {cpu.engine_s_per_request * 1e3:.2f} ms/request"
            f" (+ {cpu.engine_s_per_remote_request * 1e3:.2f} from a prefill worker;"
            f" the prefill worker {cpu.prefill_engine_s_per_request * 1e3:.2f})"
            f" + {cpu.engine_s_per_step * 1e3:.3f} ms/step"
            f" + {cpu.engine_s_per_token * 1e3:.3f} ms/output token"
        )
    if handoff is not None:
        link = profile.handoff_fixed_s or 0.0
        lines.append(
            f"  handoff  {handoff[0] * 1e3:.2f} ms + {handoff[1] * 1e12:.2f} ps/byte (the simulator's link "
            f"{link * 1e3:.2f} ms: less the engines' own CPU it puts in their steps)"
        )
    data = {**profile.to_json(), "path": args.out}
    return emit(args, data, lines)


def cmd_retime(args: argparse.Namespace) -> int:
    """`sim retime`: the profile's step times re-timed from a live engine's step log."""
    profile = load_profile(args.profile)
    try:
        records = read_step_log(args.step_log)
    except OSError as exc:
        raise CalibrationError(f"--step-log {args.step_log}: cannot read it ({exc})") from None
    except ValueError as exc:
        raise CalibrationError(f"--step-log {exc}") from None
    if args.before is not None:
        records = [r for r in records if r.t < args.before]
    if not records:
        before = f" before {args.before}" if args.before is not None else ""
        raise CalibrationError(f"--step-log {args.step_log}: no steps logged{before}")
    retimed, factors = retime_profile(profile, records, waits=args.waits)
    if args.bench is not None:
        retimed = replace(retimed, path=path_of_bench_run(args.bench))
    save_profile(retimed, args.out)
    lines = [f"{args.profile} re-timed by the steps of {args.step_log} -> {args.out}"]
    lines += ["  " + row for row in factor_rows(factors)]
    waits = retimed.waits.to_json() if retimed.waits else None
    lines += ["  " + row for row in wait_rows(retimed.waits)] if retimed.waits else []
    lines += ["  " + path_row(retimed.path)] if retimed.path else []
    path = retimed.path._asdict() if retimed.path else None
    data = {"path": args.out, "factors": [f._asdict() for f in factors], "waits": waits, "path_latency": path}
    return emit(args, data, lines)


def path_of_bench_run(file: str) -> PathLatency:
    """The path latency fitted from a bench run's JSON; CalibrationError naming the file."""
    try:
        return fit_path_latency(read_json(file))
    except ValueError as exc:
        raise CalibrationError(f"--bench {file}: {exc}") from None
