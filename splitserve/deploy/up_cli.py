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
import signal
import socket
import sys
import time

import httpx

from splitserve.deploy.supervisor import Part, Supervisor, start_part
from splitserve.frontend.stream_state import STATE_KEY_ENV
from splitserve.protocol.drain import add_serving_arguments
from splitserve.protocol.http_edge import DEFAULT_MAX_BODY_BYTES

_POLL_S = 0.2


def _free_port(host: str, taken: int) -> int:
    """A free port other than `taken` (the proxy's, bound last: the OS may offer it again)."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port != taken:
            return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model directory (default: the demo model)")
    parser.add_argument(
        "--prefill", type=int, default=1, help="prefill engines (0: decode prefills everything)"
    )
    parser.add_argument("--decode", type=int, default=1, help="decode engines")
    parser.add_argument("--render", type=int, default=1, help="render tier replicas")
    parser.add_argument(
        "--transport", choices=["shm", "tcp"], default=None, help="KV transport (default: the engines')"
    )
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's (OpenAI API) port")
    parser.add_argument(
        "--min-prefill-tokens", type=int, default=64, help="shorter prompts skip the prefill pool"
    )
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine")
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
    add_serving_arguments(parser)
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for every part")
    parser.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )


def _engine_args(args: argparse.Namespace) -> list[str]:
    extra: list[str] = ["--kv-mode", args.mode, "--log-level", args.log_level]
    extra += ["--drain-timeout", str(args.drain_timeout)]
    for flag, value in (
        ("--kv-transport", args.transport),
        ("--num-blocks", args.num_blocks),
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--max-model-len", args.max_model_len),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--dtype", args.dtype),
        ("--kv-timeout", args.kv_timeout),
        ("--kv-reservation-ttl", args.kv_reservation_ttl),
    ):
        if value is not None:
            extra += [flag, str(value)]
    return extra


def _start(name: str, command: list[str], host: str, port: int, env: dict[str, str] | None = None) -> Part:
    return start_part(name, command, f"http://{host}:{port}", env)


def _wait_healthy(parts: list[Part], timeout_s: float) -> str | None:
    """None when every part answers /health; else why not."""
    deadline = time.monotonic() + timeout_s
    pending = list(parts)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for part in list(pending):
                if part.process.poll() is not None:
                    return f"{part.name} exited with code {part.process.returncode} while starting"
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{part.url}/health").status_code == 200:
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
        if part.process.poll() is None:
            part.process.kill()
        part.process.wait()


def _stop_draining(parts: list[Part], drain_timeout_s: float, at_once: list[int]) -> None:
    """The proxy first: it drains its streams while the parts behind it still serve
    them; then the others, which have nothing left in flight."""
    front = [p for p in parts if p.name == "proxy"]
    _stop(front, drain_timeout_s + 15, at_once)
    _stop([p for p in parts if p.name != "proxy"], drain_timeout_s + 15, at_once)


def run(args: argparse.Namespace) -> int:
    if args.decode < 1 or args.prefill < 0 or args.render < 1:
        print("splitserve up: need --decode >= 1, --render >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    from splitserve.model.tiny import resolve_model

    model = resolve_model(args.model)
    host = args.host
    stop_requested: list[int] = []

    stop_at_once: list[int] = []

    def request_stop(signum: int, _frame: object) -> None:
        (stop_at_once if stop_requested else stop_requested).append(signum)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    parts: list[Part] = []
    try:
        render = ["render", model, "--host", host, "--log-level", args.log_level]
        render += ["--max-body-bytes", str(args.max_body_bytes), "--drain-timeout", str(args.drain_timeout)]
        if args.max_model_len:
            render += ["--max-model-len", str(args.max_model_len)]
        if args.trust_request_chat_template:
            render.append("--trust-request-chat-template")
        # The render replicas share a fresh signing key for their stream states (unless one
        # is set), so any replica continues any stream.
        render_env = {STATE_KEY_ENV: secrets.token_hex(32), **os.environ}
        for index in range(args.render):
            render_port = _free_port(host, args.port)
            name = "render" if args.render == 1 else f"render-{index}"
            parts.append(_start(name, [*render, "--port", str(render_port)], host, render_port, render_env))
        engines = [("prefill", i) for i in range(args.prefill)] + [("decode", i) for i in range(args.decode)]
        for role, index in engines:
            port = _free_port(host, args.port)
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
            ]
            parts.append(_start(f"{role}-{index}", command, host, port))
        error = _wait_healthy(parts, args.startup_timeout)
        if error is None and not stop_requested:
            proxy = [
                "proxy", "--render", *[p.url for p in parts if p.name.startswith("render")],
                "--host", host, "--port", str(args.port),
                "--mode", args.mode, "--min-prefill-tokens", str(args.min_prefill_tokens),
                "--log-level", args.log_level, "--max-body-bytes", str(args.max_body_bytes),
                "--drain-timeout", str(args.drain_timeout), "--max-in-flight", str(args.max_in_flight),
                "--prefill", *[p.url for p in parts if p.name.startswith("prefill")],
                "--decode", *[p.url for p in parts if p.name.startswith("decode")],
            ]  # fmt: skip
            parts.append(_start("proxy", proxy, host, args.port))
            error = _wait_healthy(parts[-1:], args.startup_timeout)
        if error is not None:
            print(f"splitserve up: {error}", file=sys.stderr)
            return 1
        if stop_requested:
            return 0
        transport = args.transport or "default"
        print(f"splitserve up: {args.prefill} prefill + {args.decode} decode, {transport}/{args.mode}")
        for part in parts:
            print(f"  {part.name:<10} {part.url}  (pid {part.process.pid})")
        print(f"OpenAI API: {parts[-1].url}/v1  (Ctrl-C stops everything)", flush=True)
        supervisor = Supervisor(parts)
        while not stop_requested:
            error = supervisor.poll()
            if error is not None:
                print(f"splitserve up: {error}; stopping", file=sys.stderr)
                return 1
            time.sleep(_POLL_S)
        return 0
    finally:
        _stop_draining(parts, args.drain_timeout, stop_at_once)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("splitserve up: stopped", file=sys.stderr)
