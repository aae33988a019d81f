"""Drain on SIGTERM: every part's HTTP server (`engine`, `render`, `proxy`, `serve`).

The first SIGTERM or SIGINT stops new work: new generate/render/chat requests get a 503
with `Retry-After` and `/health` answers 503 (unready, so a proxy or balancer stops
sending here), while requests in flight (streams included) run to their end; the server
exits once none is left or `--drain-timeout` has passed. Requests that continue work in
flight (derender pieces, KV reservations, aborts) are still served while draining. A
second SIGINT stops at once (Ctrl-C twice).

Overload: past `--max-in-flight` new-work requests at once, a new one gets a 429 with
`Retry-After` at once instead of waiting in an unbounded queue.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from splitserve.protocol.errors import error_body
from splitserve.runtime.http_pool import SERVER_KEEPALIVE_S

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_IN_FLIGHT = 1024
# Set by `up` for its parts: SIGINT is for `up` (it stops them in order), SIGTERM for them.
SUPERVISED_ENV = "SPLITSERVE_SUPERVISED"
RETRY_AFTER_S = 1
# Requests that start new work; everything else continues work already admitted.
NEW_WORK_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/inference/v1/generate",
    }
)


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        help="new requests (generate, render, chat, completions) served at once; past it: 429",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, seconds to let requests in flight finish before exiting (a second signal: at once)",
    )


class DrainState:
    """Whether the server drains, since when, and how many HTTP requests are in flight."""

    def __init__(self, max_new_work: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self.draining_since: float | None = None
        self.in_flight = 0
        self.new_work = 0  # of `in_flight`, requests on NEW_WORK_PATHS
        self.max_new_work = max_new_work


class DrainMiddleware:
    """ASGI: counts requests in flight (until their last body byte); while draining,
    refuses new work with 503 + Retry-After and reports /health unready; past the limit
    of new work, refuses it with 429 + Retry-After."""

    def __init__(self, app: Any, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        new_work = path in NEW_WORK_PATHS
        if self.state.draining_since is not None and (new_work or path == "/health"):
            await _refuse(send, 503, path)
            return
        if new_work and self.state.new_work >= self.state.max_new_work:
            await _refuse(send, 429, path)
            return
        self.state.in_flight += 1
        self.state.new_work += new_work
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
            self.state.new_work -= new_work


async def _refuse(send: Any, status: int, path: str) -> None:
    if path == "/health":
        body: dict = {"status": "draining"}
    elif status == 429:
        body = error_body(429, "the server is at its limit of requests in flight; retry later")
    else:
        body = error_body(503, "the server is shutting down; retry on another replica")
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal drains instead of closing at once."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState, drain_timeout_s: float, supervised: bool
    ) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.supervised = supervised

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.supervised and sig == signal.SIGINT:
            return  # the terminal's Ctrl-C: `up` sends SIGTERM in order, SIGKILL the second time
        if self.state.draining_since is None:
            self.state.draining_since = time.monotonic()
        elif sig == signal.SIGINT:  # Ctrl-C twice: stop now
            self.should_exit = True
            self.force_exit = True
        # A SIGTERM while draining changes nothing: `up` sends one to parts that a
        # terminal's Ctrl-C (sent to the whole process group) already set draining.

    async def shutdown(self, sockets: Any = None) -> None:
        if self.force_exit:  # stop now: cut the responses still running
            for task in list(self.server_state.tasks):
                task.cancel()
        await super().shutdown(sockets)

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        since = self.state.draining_since
        if since is not None and not should_exit:
            timed_out = time.monotonic() - since > self.drain_timeout_s
            if self.state.in_flight == 0 or timed_out:
                self.should_exit = True
        return self.should_exit


def serve_draining(
    app: Any, *, host: str, port: int, log_level: str, drain_timeout_s: float, max_in_flight: int
) -> None:
    """Run `app` with uvicorn until it has drained (see the module docstring)."""
    state = DrainState(max_in_flight)
    config = uvicorn.Config(
        DrainMiddleware(app, state),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
    )
    # What start-up made (modules, torch's op tables: millions of objects) lives as long as
    # the process: kept out of the cyclic collector, it costs neither GC pauses while serving
    # nor the ~0.3 s the interpreter's last collection would spend on it at exit.
    gc.freeze()
    DrainingServer(config, state, drain_timeout_s, os.environ.get(SUPERVISED_ENV) == "1").run()
