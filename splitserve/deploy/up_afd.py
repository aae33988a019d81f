"""`splitserve up MODEL --afd A:F`: attention-FFN disaggregation of the decode side
(docs/afd.md). A attention engines are the decode tier (`--decode A`, P/D in front
unchanged) and F FFN daemons hold the experts; decode engine `i` calls daemon `i % F`,
so several attention engines share one daemon. The daemons are parts like any other:
started before the decode engines, restarted when they die, stopped with `up`. With
`--ray` the daemons are the `ffn` tier of the Serve application (ray_serve/, docs/ray.md)."""

from __future__ import annotations

import argparse


def afd_ratio(text: str) -> tuple[int, int]:
    """`A:F` (attention engines : FFN daemons), both >= 1."""
    attention, sep, ffn = text.partition(":")
    if not sep or not attention.strip().isdigit() or not ffn.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"--afd takes A:F (attention engines:FFN daemons), e.g. 2:1; not {text!r}"
        )
    ratio = int(attention), int(ffn)
    if min(ratio) < 1:
        raise argparse.ArgumentTypeError(f"--afd {text}: both counts must be >= 1")
    return ratio


def add_afd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--afd",
        type=afd_ratio,
        default=None,
        metavar="A:F",
        help="attention-FFN disaggregation (MoE models): A attention engines as the decode "
        "tier, F FFN daemons holding the experts, e.g. 2:1",
    )
    parser.add_argument(
        "--afd-microbatches",
        type=int,
        choices=[1, 2],
        default=None,
        help="with --afd: the attention engines' decode steps of >= 2 sequences as 2 "
        "overlapped micro-batches or 1 (their default; docs/afd.md: which pays where)",
    )
    parser.add_argument(
        "--afd-transport",
        choices=["shm", "tcp", "auto"],
        default=None,
        help="with --afd: how a layer's tensors reach the FFN daemon: shared memory (the "
        "default: every part is on this host), tcp frames, or auto",
    )


def afd_flag_error(args: argparse.Namespace) -> str | None:
    """Why `--afd` cannot go with these flags (None: it can, or is not given). Sets
    `args.decode` to A."""
    if args.afd is None:
        for flag in ("afd_microbatches", "afd_transport"):
            if getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} needs --afd"
        return None
    attention, _ = args.afd
    if args.plan:
        return "--plan does not plan --afd layouts"
    if "--decode" in args.layout_flags and args.decode != attention:
        return f"--afd {attention}:{args.afd[1]} runs {attention} decode engines, not --decode {args.decode}"
    args.decode = attention
    if args.afd_transport is None:
        # `up` starts every part on this host; Ray places them on any node (auto: shm
        # with a daemon on the engine's host, tcp with one elsewhere)
        args.afd_transport = "auto" if args.ray is not None else "shm"
    return None


def afd_model_error(model_path: str) -> str | None:
    """Why this model cannot be split (None: it is a mixture-of-experts model). Read as
    the planner reads it (no torch in `up`)."""
    from splitserve.deploy.up_plan import model_spec_of
    from splitserve.sim.specs import SpecError

    try:
        spec = model_spec_of(model_path)
    except (OSError, ValueError, SpecError) as exc:
        return f"--afd: cannot read the model's config: {exc}"
    if not spec.is_moe:
        return "--afd needs a mixture-of-experts model (e.g. qwen3_moe); this one has no MoE layers"
    if spec.is_hybrid:  # the attention engine refuses it too (engine/model_runner.py)
        return "--afd does not split hybrid (Mamba) models yet: serve this one without --afd"
    return None


def ffn_addresses(host: str, ffn_ports: list[int], decode_engines: int) -> list[str]:
    """The FFN daemon each decode engine calls: round robin over the daemons."""
    return (
        [f"{host}:{ffn_ports[index % len(ffn_ports)]}" for index in range(decode_engines)]
        if ffn_ports
        else []
    )
