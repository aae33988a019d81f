"""`splitserve up [MODEL]`: the whole disaggregated stack on this machine.

Starts a render tier, N prefill and M decode engines and the proxy as processes on free
local ports, waits until each is healthy, prints the endpoints, and shuts everything down
on Ctrl-C / SIGTERM (draining: the proxy finishes its streams first; Ctrl-C twice stops at
once). A part that dies is started again (`deploy/supervisor.py`); `up` stops only on
request or when a part cannot start at all.

`run` is plan (`deploy/plan.py`: every tier's command line, the one `up --ray` deploys
too), start and supervise (`deploy/local_stack.py`). `--plan --rate R` first lets the
simulator choose the engines and their CPUs for this host (`deploy/up_plan.py`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from rich.console import Console

from splitserve.config import KV_CACHE_DTYPES, UP_LONG_PREFILL_TOKEN_THRESHOLD
from splitserve.deploy.cpu_affinity import parse_cpu_affinity
from splitserve.deploy.local_stack import LocalStack, remove_stale_directories
from splitserve.deploy.plan import deployment_secrets, part_names, plan_from_args, up_replicas
from splitserve.deploy.supervisor import Part
from splitserve.deploy.up_afd import add_afd_arguments, afd_flag_error, afd_model_error
from splitserve.deploy.up_plan import NoteGiven, add_plan_arguments, plan_flag_error, plan_layout
from splitserve.frontend.media_cli import add_media_arguments
from splitserve.kv.transport.nixl_package import NIXL_MISSING, nixl_present
from splitserve.model_files.architectures import is_hybrid_model
from splitserve.ray_serve.cli import add_ray_arguments
from splitserve.runtime.access import API_KEY_ENV
from splitserve.runtime.drain import add_serving_arguments
from splitserve.runtime.http_edge import DEFAULT_MAX_BODY_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="GGUF file, model directory or HF ID (default: the demo model)"
    )
    parser.add_argument("--served-model-name", default=None, help="model name clients use")
    parser.add_argument("--reasoning-parser", choices=["auto", "qwen3", "none"], default="auto")
    parser.add_argument("--tool-call-parser", choices=["auto", "hermes", "none"], default="auto")
    parser.add_argument(
        "--prefill",
        type=int,
        default=1,
        action=NoteGiven,
        help="prefill engines (0: decode prefills everything)",
    )
    parser.add_argument("--decode", type=int, default=1, action=NoteGiven, help="decode engines")
    parser.add_argument("--render", type=int, default=1, help="render tier replicas")
    parser.add_argument(
        "--encoder",
        type=int,
        default=0,
        help="encoder workers (vision-language models: images encoded once, shared by shm)",
    )
    parser.add_argument(
        "--transport",
        "--kv-transport",
        dest="transport",
        choices=["shm", "tcp", "nixl"],
        default=None,
        help="KV transport (default: the engines'); nixl needs pip install 'splitserve[nixl]'",
    )
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument(
        "--kv-bidirectional",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="push: prefill pulls the prefix decode holds (by block hash) instead of computing it",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="the proxy's address; every other part binds loopback"
    )
    parser.add_argument(
        "--api-key", default=None, help=f"the OpenAI API's key (default: ${API_KEY_ENV}; none: open)"
    )
    parser.add_argument(
        "--open-health-metrics", action="store_true", help="the proxy's /health and /metrics need no key"
    )
    parser.add_argument(
        "--max-in-flight-per-client",
        type=int,
        default=None,
        help="the proxy's: chat/completions requests one client address may have in flight (0: any)",
    )
    parser.add_argument(
        "--max-kv-blocks-per-client",
        type=int,
        default=None,
        help="the proxy's: KV blocks one client's running prompts may take on decode (0: any)",
    )
    parser.add_argument(
        "--quota-by",
        nargs="+",
        choices=["address", "api-key"],  # the proxy's --quota-by
        default=None,
        help="the proxy's: per-client bounds count each address, each API key, or both",
    )
    parser.add_argument("--port", type=int, default=8000, help="the proxy's (OpenAI API) port")
    parser.add_argument(
        "--pd-decision",
        choices=["cost", "threshold"],
        default="cost",
        help="the proxy's: which prompts go through the prefill pool (cost: per request, by "
        "load and measured costs; threshold: --min-prefill-tokens)",
    )
    parser.add_argument(
        "--pd-cost-profile", default=None, metavar="FILE", help="the proxy's cost decision numbers (JSON)"
    )
    parser.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=64,
        help="--pd-decision threshold: prompts with fewer uncached tokens skip the prefill pool",
    )
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine")
    parser.add_argument("--kv-overlap-weight", type=float, default=None, help="the proxy's routing weight")
    parser.add_argument("--kv-load-weight", type=float, default=None, help="the proxy's routing weight")
    parser.add_argument(
        "--kv-prefill-load-weight", type=float, default=None, help="the proxy's routing weight"
    )
    parser.add_argument(
        "--kv-decode-load-weight", type=float, default=None, help="the proxy's routing weight"
    )
    parser.add_argument(
        "--routing",
        choices=["cache-aware", "least-loaded", "round-robin", "text-prefix"],  # the proxy's --routing
        default=None,
        help="the proxy's worker picking (default cache-aware)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="the proxy's: seconds a decode stream may be silent before its worker is probed (5)",
    )
    parser.add_argument(
        "--resume-wait",
        type=float,
        default=None,
        help="the proxy's: seconds a stream may wait for a decode worker to come back (60)",
    )
    parser.add_argument(
        "--liveness-timeout",
        type=float,
        default=30.0,
        help="a part alive but not answering /health this long (stopped, wedged) is killed "
        "and started again (0: never)",
    )
    parser.add_argument("--kv-cache-memory", default=None, help="KV budget per engine, e.g. 512MiB")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--long-prefill-token-threshold", type=int, default=UP_LONG_PREFILL_TOKEN_THRESHOLD,
        help="engines: a prompt computes at most this many tokens in a step that carries "
        "decodes, so a local prefill on decode stalls its streams a chunk at a time (0: no cap)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="engines' compute dtype (default: the one config.json names)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
        help="engines' KV cache element type (default auto: the compute dtype; float16 under "
        "float32 activations, a quantized GGUF file's, halves the bytes decode attention reads)",
    )  # fmt: skip
    parser.add_argument(
        "--quantization", choices=["auto", "gguf", "none"], default=None,
        help="engines: gguf keeps a GGUF file's Q8_0/Q4_0/Q4_1 projections quantized "
        "(default auto: gguf for a GGUF file unless --dtype is named)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-store", action="store_true",
        help="run a KV store tier (`splitserve kvstore`): the engines offload the blocks their "
        "prefix caches evict to it and load a prompt's missing leading blocks from it",
    )  # fmt: skip
    parser.add_argument("--kv-store-ram-gb", type=float, default=4.0, help="with --kv-store: RAM tier, GiB")
    parser.add_argument("--kv-store-disk", default=None, metavar="DIR", help="with --kv-store: disk tier")
    parser.add_argument("--kv-store-disk-gb", type=float, default=None, help="with --kv-store-disk: GiB")
    parser.add_argument("--kv-timeout", type=float, default=None)
    parser.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="every engine appends one JSON line per step to FILE (engine --step-log)",
    )
    parser.add_argument("--kv-reservation-ttl", type=float, default=None)
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="request body limit (proxy, render)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry a chat_template (render; sandboxed, but it costs CPU and memory)",
    )
    add_media_arguments(parser)  # render: image sources, limits, pixel dtype
    add_serving_arguments(parser)
    parser.add_argument(
        "--cpu-affinity",
        action="append",
        default=[],
        metavar="PART=CPUS",
        help="pin parts to CPUs, e.g. prefill=0,decode=1 (a role or a part such as decode-1; repeatable)",
    )
    parser.add_argument(
        "--no-lend-idle-cpus",
        action="store_true",
        help="with --cpu-affinity: a prefill never runs on an idle decode's CPUs (by default a "
        "pinned prefill borrows them for its large steps while that decode has nothing to compute)",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for every part")
    parser.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_afd_arguments(parser)  # --afd A:F: the decode side as attention engines and FFN daemons
    add_plan_arguments(parser)  # --plan --rate R: the layout the simulator picks for this host
    add_ray_arguments(parser)  # --ray [ADDRESS]: the same stack as a Ray Serve application


def run(args: argparse.Namespace) -> int:
    """Plan, start, supervise: until a stop is asked for or a part cannot start."""
    from splitserve.model_files.resolve import resolve_model_or_exit

    error = plan_flag_error(args) or afd_flag_error(args)
    if error is not None:
        print(f"splitserve up: {error}", file=sys.stderr)
        return 2
    resolved = None
    if args.plan:
        resolved = resolve_model_or_exit(args.model)
        try:
            layout = plan_layout(args, resolved.path, Console(soft_wrap=True, highlight=False, markup=False))
        except ValueError as exc:  # a bad profile, lengths file or model config
            print(f"splitserve up: --plan: {exc}", file=sys.stderr)
            return 2
        if layout is None:
            return 1
        if args.dry_run:
            return 0
        # the pick, as the flags would have given it
        args.prefill, args.decode = layout.prefill, layout.decode
        args.cpu_affinity = layout.cpu_affinity(sorted(os.sched_getaffinity(0)))
    if args.ray is not None:
        if args.afd and args.model and os.path.isdir(args.model):  # else the nodes resolve it
            error = afd_model_error(args.model)
            if error is not None:
                print(f"splitserve up: {error}", file=sys.stderr)
                return 2
        if args.cpu_affinity:
            print("splitserve up: --cpu-affinity pins local processes; Ray places --ray's", file=sys.stderr)
            return 2
        from splitserve.ray_serve.cli import run_up

        return run_up(args)
    if args.transport == "nixl" and not nixl_present():
        print(f"splitserve up: --transport nixl: {NIXL_MISSING}", file=sys.stderr)
        return 2
    if args.decode < 1 or args.prefill < 0 or args.render < 1:
        print("splitserve up: need --decode >= 1, --render >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    try:
        pinned = parse_cpu_affinity(args.cpu_affinity, part_names(up_replicas(args)))
    except ValueError as exc:
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 2
    resolved = resolved or resolve_model_or_exit(args.model)
    if is_hybrid_model(resolved.path) and args.mode == "pull":
        # the Mamba state travels whole in a push (docs/pd.md, "Hybrid models")
        print(
            "splitserve up: a hybrid (Mamba) model's state is handed over in push mode only: "
            "drop --mode pull",
            file=sys.stderr,
        )
        return 2
    error = afd_model_error(resolved.path) if args.afd else None
    if error is not None:
        print(f"splitserve up: {error}", file=sys.stderr)
        return 2
    try:
        plan = plan_from_args(args, resolved.path, args.served_model_name or resolved.name)
    except ValueError as exc:  # sizes the store cannot take
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 2
    remove_stale_directories()
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    stack = LocalStack(
        plan, deployment_secrets(api_key), pinned, args.host, args.port, not args.no_lend_idle_cpus
    )
    previous = {sig: signal.signal(sig, stack.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        error = stack.start(args.startup_timeout)
        if error is not None:
            print(f"splitserve up: {error}", file=sys.stderr)
            return 1
        if stack.stop_requested:
            return 0
        print_endpoints(args, stack.parts)
        return stack.supervise(args.liveness_timeout)
    finally:
        stack.stop(args.drain_timeout)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("splitserve up: stopped", file=sys.stderr)


def print_endpoints(args: argparse.Namespace, parts: list[Part]) -> None:
    transport = args.transport or "default"
    encoders = f" + {args.encoder} encoder" if args.encoder else ""
    ffn = f" (attention) + {args.afd[1]} ffn" if args.afd else ""
    ffn += " + KV store" if args.kv_store else ""
    print(
        f"splitserve up: {args.prefill} prefill + {args.decode} decode{ffn}{encoders}, "
        f"{transport}/{args.mode}"
    )
    for part in parts:
        cpus = f"  CPUs {','.join(map(str, sorted(part.cpus)))}" if part.cpus else ""
        print(f"  {part.name:<10} {part.url}  (pid {part.process.pid}){cpus}")
    print(f"OpenAI API: {parts[-1].url}/v1  (Ctrl-C stops everything)", flush=True)
