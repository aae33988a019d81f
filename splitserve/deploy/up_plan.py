"""`splitserve up MODEL --plan --rate R [--slo-ttft S --slo-tpot S --slo-gap S]`: the layout
the planner picks for this host, then `up` of exactly that layout.

The planner (sim/host_planner.py, pure) simulates every layout of the CPUs this process
may use (os.sched_getaffinity): collocated `--decode N` (one engine: a `serve`-like stack)
and `--prefill P --decode D`, each engine pinned to its share of the cores. Its engine
costs come from `--profile FILE` (`splitserve sim calibrate --engine URL --out FILE`) or,
without one, from the simulator's roofline of the model at its realistic preset; the
request lengths from `--lengths` (observed requests, or PROMPT/OUTPUT length specs). The
candidates are printed best first with their predicted attainment and goodput, and the
pick becomes `up`'s `--prefill`, `--decode` and `--cpu-affinity`: the same path as those
flags given by hand. `--dry-run` prints and exits.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from splitserve.config import SchedulerConfig
from splitserve.goodput import SLO, SLO_AVERAGE, SLO_WORST_GAP, parse_duration
from splitserve.sim.host_planner import (
    DEFAULT_MAX_ENGINES,
    HostLayout,
    RankedLayout,
    host_deployment,
    host_layouts,
    rank_layouts,
)
from splitserve.sim.metrics import WorkloadFactory
from splitserve.sim.profile import load_profile
from splitserve.sim.specs import ModelSpec, SpecError, load_model, model_from_hf_config
from splitserve.sim.steady import SteadyState
from splitserve.sim.workload import Workload, load_lengths, observed, synthetic

DEFAULT_LENGTHS = "256/64"  # `splitserve bench`'s default --input-len / --output-len
PLAN_ONLY = ("rate", "slo_ttft", "slo_tpot", "slo_gap", "profile", "lengths", "dry_run")
RAY_PLANNER_FLAGS = ("slo_ttft", "slo_tpot", "slo_gap", "profile")
# a steady-state run of the simulator: long enough for a 95% interval of +-3 points
PLAN_STEADY_STATE = SteadyState(half_width=0.03, max_requests=3200)


class NoteGiven(argparse.Action):
    """Stores the value and notes the flag as given: `--plan` refuses the layout flags it
    would choose itself, and their defaults must not count as a choice."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.layout_flags = (*getattr(namespace, "layout_flags", ()), option_string)


def duration_s(text: str) -> float:
    """`2s`, `200ms`, or plain seconds (`0.2`)."""
    try:
        value = float(text)
    except ValueError:
        try:
            value = parse_duration(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a bound must be > 0")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(layout_flags=())
    group = parser.add_argument_group("planning (--plan: the layout the simulator picks for this host)")
    group.add_argument(
        "--plan",
        action="store_true",
        help="simulate the layouts this host's cores allow and start the best for --rate "
        "(not with --prefill, --decode or --cpu-affinity: it chooses them)",
    )
    group.add_argument("--rate", type=float, default=None, help="--plan: requests per second to serve")
    group.add_argument("--slo-ttft", type=duration_s, default=None, metavar="S", help="--plan: TTFT bound")
    group.add_argument("--slo-tpot", type=duration_s, default=None, metavar="S", help="--plan: TPOT bound")
    group.add_argument(
        "--slo-gap", type=duration_s, default=None, metavar="S", help="--plan: worst gap between two tokens"
    )
    group.add_argument(
        "--target", type=float, default=0.9, help="--plan: fraction of requests that must meet the SLO"
    )
    group.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="--plan: the engine's measured costs (`splitserve sim calibrate --engine URL --out FILE`)",
    )
    group.add_argument(
        "--lengths",
        default=None,
        metavar="FILE|SPEC",
        help="--plan: observed requests (JSONL of token counts, a bench dataset or `bench --json` "
        f"results) or PROMPT/OUTPUT token counts such as 256/64 or uniform:64:512/32 ({DEFAULT_LENGTHS})",
    )
    group.add_argument(
        "--plan-max-engines", type=int, default=DEFAULT_MAX_ENGINES, help="--plan: most engines to consider"
    )
    group.add_argument("--dry-run", action="store_true", help="--plan: print the plan, start nothing")


def plan_flag_error(args: argparse.Namespace) -> str | None:
    """Why these flags cannot plan (None: they can)."""
    if args.ray_planner and args.ray is None:
        return "--ray-planner plans a Ray deployment: only with --ray"
    if not args.plan:
        # --ray-planner takes --plan's SLOs, target and profile
        allowed = RAY_PLANNER_FLAGS if args.ray_planner else ()
        given = [
            f"--{n.replace('_', '-')}"
            for n in PLAN_ONLY
            if getattr(args, n) not in (None, False) and n not in allowed
        ]
        return f"{', '.join(given)}: only with --plan" if given else None
    chosen = [*args.layout_flags, *(["--cpu-affinity"] if args.cpu_affinity else [])]
    if chosen:
        return f"--plan chooses the layout itself: drop {', '.join(dict.fromkeys(chosen))}"
    if args.ray is not None:
        return "--plan starts a local layout; not with --ray"
    if args.rate is None or not args.rate > 0:
        return "--plan needs --rate R (requests per second, > 0)"
    if not 0 < args.target <= 1:
        return "--target must be in (0, 1]"
    if args.plan_max_engines < 1:
        return "--plan-max-engines must be >= 1"
    return None


def slos_of(args: argparse.Namespace) -> list[SLO]:
    """The one SLO the flags give, or `bench`'s and `sim plan`'s two defaults."""
    if args.slo_ttft is None and args.slo_tpot is None and args.slo_gap is None:
        return [SLO_AVERAGE, SLO_WORST_GAP]
    return [SLO(ttft=args.slo_ttft, tpot=args.slo_tpot, gap=args.slo_gap)]


def workload_of(lengths: str | None) -> tuple[WorkloadFactory, str]:
    """(rate, requests, seed) -> the simulated requests, and what they are, in words."""
    text = lengths or DEFAULT_LENGTHS
    if lengths and Path(lengths).is_file():
        pairs = load_lengths(lengths)

        def from_file(rate: float, n: int, seed: int) -> Workload:
            return observed(rate, n, pairs, seed=seed)

        return from_file, f"lengths of the {len(pairs[0])} requests in {lengths}"
    prompt, slash, output = text.partition("/")
    if not slash or not prompt or not output:
        raise ValueError(f"--lengths {text!r}: no such file, and not PROMPT/OUTPUT (e.g. 256/64)")

    def from_spec(rate: float, n: int, seed: int) -> Workload:
        return synthetic(rate, n, prompt, output, seed=seed)

    from_spec(1.0, 1, 0)  # a bad length spec fails here, with its message
    return from_spec, f"prompts {prompt} tokens, outputs {output}"


def gguf_model_spec(path: str) -> ModelSpec:
    """A GGUF file's shape, from its metadata (llama.cpp's keys for the HF config's)."""
    from splitserve.gguf_file import metadata_value, open_gguf

    reader = open_gguf(path)
    arch = metadata_value(reader, "general.architecture")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens", [])
    config = {
        "num_hidden_layers": metadata_value(reader, f"{arch}.block_count"),
        "hidden_size": metadata_value(reader, f"{arch}.embedding_length"),
        "num_attention_heads": metadata_value(reader, f"{arch}.attention.head_count"),
        "num_key_value_heads": metadata_value(reader, f"{arch}.attention.head_count_kv"),
        "head_dim": metadata_value(reader, f"{arch}.attention.key_length"),
        "intermediate_size": metadata_value(reader, f"{arch}.feed_forward_length"),
        "vocab_size": len(tokens) or None,
        # the engine dequantizes a GGUF's weights, then serves them in bf16 where the CPU has
        # native bf16 matmul: float32 is the most the weights can take
        "torch_dtype": "float32",
    }
    return model_from_hf_config(config, name=Path(path).stem)


def model_spec_of(path: str) -> ModelSpec:
    if Path(path).suffix.lower() == ".gguf":
        return gguf_model_spec(path)
    if not (Path(path) / "config.json").is_file():
        raise SpecError(f"{path}: --plan needs the model's config.json (or a GGUF file)")
    return load_model(path)


def plan_layout(args: argparse.Namespace, model_path: str, out: Console) -> HostLayout | None:
    """Rank this host's layouts for the flags, print them, and return the pick (None:
    none meets the target at the rate). Bad input raises ValueError (its subclasses)."""
    cpus = sorted(os.sched_getaffinity(0))
    profile = load_profile(args.profile) if args.profile else None
    make, lengths_text = workload_of(args.lengths)
    slos = slos_of(args)
    # the engines' scheduler as `up` starts them (its long-prefill threshold, not the engine's)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens or SchedulerConfig.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    base = host_deployment(model_spec_of(model_path), profile, scheduler, args.mode)
    layouts = host_layouts(cpus, args.plan_max_engines)
    prompt_tokens = float(make(1.0, 200, 0).prompt.mean())
    measured_cores = (profile.threads if profile else None) or len(cpus)
    measured = profile.measured_steps() if profile else {}
    with Console(stderr=True).status(f"simulating {len(layouts)} layouts"):
        ranked = rank_layouts(
            layouts, base, make, slos, args.rate, prompt_tokens, measured_cores, args.target,
            PLAN_STEADY_STATE, 4, measured_steps=measured,
        )  # fmt: skip
    threads = ", ".join(map(str, sorted(measured))) if measured else f"all {len(cpus)} CPUs (taken as)"
    costs = (
        f"engine profile {args.profile} (steps measured on engines of {threads} threads)"
        if profile
        else "no --profile: the simulator's roofline of the model at its realistic preset on "
        "nominal CPU cores (for measured costs: `splitserve sim calibrate --engine URL --out FILE`)"
    )
    out.print(
        f"splitserve up --plan: {args.rate:g} req/s on {len(cpus)} CPUs ({compact(cpus)}), "
        f"{' plus '.join(f'({s.label()})' for s in slos)} for {args.target:.0%} of requests\n"
        f"  {lengths_text}; {costs}"
    )
    wide = Console(file=out.file, width=max(out.width, 100), highlight=False, markup=False)  # a log: 80
    wide.print(plan_table(ranked, args.rate, cpus))
    best = ranked[0] if ranked and ranked[0].meets else None
    if best is None:
        top = max((r.attainment for r in ranked), default=0.0)
        out.print(f"no layout meets it at {args.rate:g} req/s (the best reaches {top:.0%}): nothing started")
        return None
    flags = [f"--prefill {best.layout.prefill}", f"--decode {best.layout.decode}"]
    flags += [f"--cpu-affinity {entry}" for entry in best.layout.cpu_affinity(cpus)]
    out.print(f"picked: {best.layout.label()} ({' '.join(flags)})")
    return best.layout


def compact(cpus: Sequence[int]) -> str:
    """0-3 for a range, else 0,2,5."""
    if list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def plan_table(ranked: list[RankedLayout], rate: float, cpus: Sequence[int]) -> Table:
    table = Table(title="candidate layouts, best first", title_justify="left", box=box.SIMPLE)
    for name in ("#", "layout", "CPUs each", "attainment", "goodput", "headroom", "via P", "met"):
        table.add_column(name, justify="left" if name == "layout" else "right", no_wrap=True)
    for i, r in enumerate(ranked, 1):
        layout = r.layout
        pins = f"{layout.cores_per_engine}" + ("" if layout.cpu_affinity(cpus) else " (all)")
        via = "-" if r.remote_fraction is None else f"{r.remote_fraction:.0%}"
        attained = r.note or f"{r.attainment:.1%} ±{r.half_width * 100:.1f}"
        table.add_row(
            f"{i}",
            layout.label(),
            pins,
            attained,
            f"{r.goodput:.1f}/s",
            f"{r.goodput / rate - 1:+.0%}",
            via,
            "yes" if r.meets else "no",
        )
    return table
