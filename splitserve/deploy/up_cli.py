"""`splitserve up [MODEL]`: the whole disaggregated stack on this machine.

Starts a render tier, N prefill and M decode engines and the proxy as processes on free
local ports, waits until each is healthy, prints the endpoints, and shuts everything down
on Ctrl-C / SIGTERM (draining: the proxy finishes its streams first; Ctrl-C twice stops at
once). A part that dies is started again (`deploy/supervisor.py`); `up` stops only on
request or when a part cannot start at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time

import httpx

from splitserve.deploy.cpu_affinity import parse_cpu_affinity
from splitserve.deploy.liveness import LivenessWatch
from splitserve.deploy.supervisor import Part, Supervisor, kill_part, start_part
from splitserve.frontend.media_cli import add_media_arguments, media_flags
from splitserve.frontend.stream_state import STATE_KEY_ENV
from splitserve.protocol.access import API_KEY_ENV, INTERNAL_TOKEN_ENV, api_keys
from splitserve.protocol.drain import add_serving_arguments
from splitserve.protocol.http_edge import DEFAULT_MAX_BODY_BYTES
from splitserve.protocol.ports import pick_free_port
from splitserve.protocol.process_lifetime import owned_directory, remove_dead_owners
from splitserve.ray_serve.cli import add_ray_arguments
from splitserve.ray_serve.config import engine_flags

_POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="GGUF file, model directory or HF ID (default: the demo model)"
    )
    parser.add_argument("--served-model-name", default=None, help="model name clients use")
    parser.add_argument("--reasoning-parser", choices=["auto", "qwen3", "none"], default="auto")
    parser.add_argument("--tool-call-parser", choices=["auto", "hermes", "none"], default="auto")
    parser.add_argument(
        "--prefill", type=int, default=1, help="prefill engines (0: decode prefills everything)"
    )
    parser.add_argument("--decode", type=int, default=1, help="decode engines")
    parser.add_argument("--render", type=int, default=1, help="render tier replicas")
    parser.add_argument(
        "--encoder",
        type=int,
        default=0,
        help="encoder workers (vision-language models: images encoded once, shared by shm)",
    )
    parser.add_argument(
        "--transport", choices=["shm", "tcp"], default=None, help="KV transport (default: the engines')"
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
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="engines' compute dtype (default: the one config.json names)",
    )  # fmt: skip
    parser.add_argument("--kv-timeout", type=float, default=None)
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
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for every part")
    parser.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_ray_arguments(parser)  # --ray [ADDRESS]: the same stack as a Ray Serve application


def _engine_args(args: argparse.Namespace) -> list[str]:
    extra: list[str] = ["--kv-mode", args.mode, "--log-level", args.log_level]
    if args.transport is not None:
        extra += ["--kv-transport", args.transport]
    return extra + list(engine_flags(args))


EC_DIRECTORY_PREFIX = "splitserve-ec-up-"


def _ec_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def ec_directory() -> str:
    """A fresh encoder-cache directory on tmpfs (where there is one), named after this `up`."""
    return owned_directory(EC_DIRECTORY_PREFIX, _ec_root())


def remove_stale_ec_directories() -> None:
    """The encoder caches of `up`s that are gone (SIGKILLed: their clean-up never ran)."""
    for path in remove_dead_owners(EC_DIRECTORY_PREFIX, _ec_root()):
        print(f"splitserve up: removed {path}, left by an up that is gone", file=sys.stderr)


def part_names(args: argparse.Namespace) -> list[str]:
    """The names `up` gives its parts, in the order it starts them."""
    renders = ["render"] if args.render == 1 else [f"render-{i}" for i in range(args.render)]
    engines = [f"{role}-{i}" for role, count in (("prefill", args.prefill), ("decode", args.decode),
               ("encoder", args.encoder)) for i in range(count)]  # fmt: skip
    return [*renders, *engines, "proxy"]


def _wait_healthy(parts: list[Part], timeout_s: float) -> str | None:
    """None when every part answers /health; else why not."""
    deadline = time.monotonic() + timeout_s
    pending = list(parts)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for part in list(pending):
                if part.process.poll() is not None:
                    return f"{part.name} exited with code {part.process.returncode} while starting"
                headers = {"Authorization": f"Bearer {part.credential}"} if part.credential else {}
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{part.url}/health", headers=headers).status_code == 200:
                        pending.remove(part)
            if time.monotonic() > deadline:
                return f"not healthy after {timeout_s:.0f}s: {', '.join(p.name for p in pending)}"
            if pending:
                time.sleep(_POLL_S)
    return None


def _stop(parts: list[Part], timeout_s: float, at_once: list[int]) -> None:
    """SIGTERM each part and wait for it to drain and exit, or kill it past `timeout_s`
    or once `at_once` holds a signal (the second Ctrl-C)."""
    for part in parts:
        if part.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                part.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for part in parts:
        while part.process.poll() is None and time.monotonic() < deadline and not at_once:
            time.sleep(_POLL_S)
        kill_part(part)


def _stop_draining(parts: list[Part], drain_timeout_s: float, at_once: list[int]) -> None:
    """The proxy first: it drains its streams while the parts behind it still serve
    them; then the others, which have nothing left in flight."""
    front = [p for p in parts if p.name == "proxy"]
    _stop(front, drain_timeout_s + 15, at_once)
    _stop([p for p in parts if p.name != "proxy"], drain_timeout_s + 15, at_once)


def run(args: argparse.Namespace) -> int:
    if args.ray is not None:
        if args.cpu_affinity:
            print("splitserve up: --cpu-affinity pins local processes; Ray places --ray's", file=sys.stderr)
            return 2
        from splitserve.ray_serve.cli import run_up

        return run_up(args)
    if args.decode < 1 or args.prefill < 0 or args.render < 1:
        print("splitserve up: need --decode >= 1, --render >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    try:
        pinned = parse_cpu_affinity(args.cpu_affinity, part_names(args))
    except ValueError as exc:
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 2

    def _start(
        name: str, command: list[str], host: str, port: int, env: dict[str, str], credential: str | None
    ) -> Part:
        return start_part(name, command, f"http://{host}:{port}", env, credential, pinned.get(name))

    from splitserve.model.resolve import resolve_model_or_exit

    resolved = resolve_model_or_exit(args.model)
    remove_stale_ec_directories()
    model = resolved.path
    host = "127.0.0.1"  # internal parts: only the proxy is exposed (--host)
    # One deployment, one internal token: every part gets it through its environment, never
    # its command line (which every user of the host can read).
    token = os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32)
    env = {**os.environ, INTERNAL_TOKEN_ENV: token}
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    proxy_env = {**env, API_KEY_ENV: api_key} if api_key else env
    stop_requested: list[int] = []

    stop_at_once: list[int] = []

    def request_stop(signum: int, _frame: object) -> None:
        (stop_at_once if stop_requested else stop_requested).append(signum)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    parts: list[Part] = []
    liveness: LivenessWatch | None = None
    cleanup: list[str] = []  # directories of this run
    picked = {args.port}  # the proxy binds last; every part's port differs from it and each other

    def free_port() -> int:
        port = pick_free_port(host, avoid=picked)
        picked.add(port)
        return port

    try:
        render = [
            "render", model, "--host", host, "--log-level", args.log_level,
            "--served-model-name", args.served_model_name or resolved.name,
            "--reasoning-parser", args.reasoning_parser, "--tool-call-parser", args.tool_call_parser,
            "--max-body-bytes", str(args.max_body_bytes), "--drain-timeout", str(args.drain_timeout),
            *media_flags(args),
        ]  # fmt: skip
        if args.max_model_len:
            render += ["--max-model-len", str(args.max_model_len)]
        if args.trust_request_chat_template:
            render.append("--trust-request-chat-template")
        # The render replicas share a fresh signing key for their stream states (unless one
        # is set), so any replica continues any stream.
        render_env = {STATE_KEY_ENV: secrets.token_hex(32), **env}
        for index in range(args.render):
            render_port = free_port()
            name = "render" if args.render == 1 else f"render-{index}"
            command = [*render, "--port", str(render_port)]
            parts.append(_start(name, command, host, render_port, render_env, token))
        engines = [("prefill", i) for i in range(args.prefill)] + [("decode", i) for i in range(args.decode)]
        engines += [("encoder", i) for i in range(args.encoder)]
        ec_flags = ["--max-pixel-bytes", str(args.max_pixel_bytes_per_request)]  # the render's limit
        if args.encoder:  # one encoder cache for the stack's engines, on this host's tmpfs
            ec_dir = ec_directory()
            cleanup.append(ec_dir)
            ec_flags += ["--ec-shm-dir", ec_dir]
        # Every P/D engine's KV socket is known up front, and each engine may dial only
        # those: a request naming any other host or port is refused (egress allow-list).
        kv_ports = {(role, index): free_port() for role, index in engines if role != "encoder"}
        kv_peers = [f"{host}:{kv_port}" for kv_port in kv_ports.values()]
        for role, index in engines:
            port = free_port()
            command = [
                "engine",
                model,
                "--role",
                role,
                "--host",
                host,
                "--port",
                str(port),
                *_engine_args(args),
                *ec_flags,
            ]
            if role != "encoder":  # KV events: the proxy's router indexes them (cache-aware routing)
                command += ["--kv-port", str(kv_ports[role, index]), "--kv-peers", *kv_peers]
                command += [
                    "--kv-events-endpoint", f"tcp://{host}:{free_port()}",
                    "--kv-events-replay-endpoint", f"tcp://{host}:{free_port()}",
                ]  # fmt: skip
            parts.append(_start(f"{role}-{index}", command, host, port, env, token))
        error = _wait_healthy(parts, args.startup_timeout)
        if error is None and not stop_requested:
            proxy = [
                "proxy", "--render", *[p.url for p in parts if p.name.startswith("render")],
                "--host", args.host, "--port", str(args.port),
                "--mode", args.mode, "--min-prefill-tokens", str(args.min_prefill_tokens),
                "--log-level", args.log_level, "--max-body-bytes", str(args.max_body_bytes),
                "--drain-timeout", str(args.drain_timeout), "--max-in-flight", str(args.max_in_flight),
                "--prefill", *[p.url for p in parts if p.name.startswith("prefill")],
                "--decode", *[p.url for p in parts if p.name.startswith("decode")],
                "--encoder", *[p.url for p in parts if p.name.startswith("encoder")],
            ]  # fmt: skip
            if args.open_health_metrics:
                proxy.append("--open-health-metrics")
            if not args.kv_bidirectional:
                proxy.append("--no-kv-bidirectional")
            for flag, value in (
                ("--kv-overlap-weight", args.kv_overlap_weight),
                ("--kv-load-weight", args.kv_load_weight),
                ("--kv-prefill-load-weight", args.kv_prefill_load_weight),
                ("--kv-decode-load-weight", args.kv_decode_load_weight),
                ("--routing", args.routing),
                ("--stall-timeout", args.stall_timeout),
                ("--resume-wait", args.resume_wait),
                ("--max-in-flight-per-client", args.max_in_flight_per_client),
                ("--max-kv-blocks-per-client", args.max_kv_blocks_per_client),
                ("--pd-decision", args.pd_decision),
                ("--pd-cost-profile", args.pd_cost_profile and os.path.abspath(args.pd_cost_profile)),
            ):
                if value is not None:
                    proxy += [flag, str(value)]
            if args.quota_by:
                proxy += ["--quota-by", *args.quota_by]
            # several keys (comma-separated, the proxy's form): up checks health with the first
            health_key = next(iter(api_keys(api_key)), None)
            parts.append(_start("proxy", proxy, args.host, args.port, proxy_env, health_key))
            error = _wait_healthy(parts[-1:], args.startup_timeout)
        if error is not None:
            print(f"splitserve up: {error}", file=sys.stderr)
            return 1
        if stop_requested:
            return 0
        transport = args.transport or "default"
        encoders = f" + {args.encoder} encoder" if args.encoder else ""
        print(
            f"splitserve up: {args.prefill} prefill + {args.decode} decode{encoders}, {transport}/{args.mode}"
        )
        for part in parts:
            cpus = f"  CPUs {','.join(map(str, sorted(part.cpus)))}" if part.cpus else ""
            print(f"  {part.name:<10} {part.url}  (pid {part.process.pid}){cpus}")
        print(f"OpenAI API: {parts[-1].url}/v1  (Ctrl-C stops everything)", flush=True)
        supervisor = Supervisor(parts)
        liveness = LivenessWatch(lambda: parts, args.liveness_timeout)
        liveness.start()
        while not stop_requested:
            error = supervisor.poll()
            if error is not None:
                print(f"splitserve up: {error}; stopping", file=sys.stderr)
                return 1
            time.sleep(_POLL_S)
        return 0
    finally:
        if liveness is not None:
            liveness.stop()  # a draining part is slow to answer: it is not to be killed
        _stop_draining(parts, args.drain_timeout, stop_at_once)
        for directory in cleanup:
            shutil.rmtree(directory, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("splitserve up: stopped", file=sys.stderr)
