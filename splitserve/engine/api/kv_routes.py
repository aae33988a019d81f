"""What a prefill or decode engine adds to the engine API for P/D: its KV connector, the
KV flags, the reservation and transfer-failure endpoints, and the handoff metrics.

- `POST /inference/v1/kv/reserve` `{request_id, timeout_s?}` (decode): waits until the
  request (sent to `/inference/v1/generate` with `kv_transfer_params.do_remote_prefill`)
  has reserved its blocks, then returns where a prefill worker must push:
  `{request_id, remote_engine_id, remote_host, remote_port, remote_block_ids,
  remote_first_block, num_cached_tokens, remote_num_tokens, transfer_mode: "push"}`.
  An empty `remote_block_ids` means decode's prefix cache already holds the prompt.
  A caller that disconnects ends the wait at once (nobody is left to answer).
  Bidirectional: `prefix_lend_id, prefix_block_ids, prefix_block_hashes` offer the leading
  blocks decode already holds (its prefix-cache hit, by chained block hash) for the
  prefill worker to pull instead of computing them (`kv/connector/prefix_lend.py`).
- `POST /inference/v1/kv/transfer_failed` `{request_id, error?}` (decode): stop waiting for
  that request's KV now (its prefill failed); it recomputes (or fails, by policy).
- `POST /inference/v1/kv/release_hold` `{request_id}` (prefill, pull mode): the proxy's
  request ended before decode read the held blocks (its client left, decode failed):
  they are freed now rather than at the hold's TTL. `{"released": false}` when nothing
  was held (already read, expired, or never held).
- `POST /inference/v1/kv/push_target` `{request_id, kv_transfer_params?}` (prefill, push):
  where a request sent with `kv_transfer_params.push_target_pending` pushes its KV (decode's
  reservation, as `/kv/reserve` answered it); without `kv_transfer_params`, nothing is to be
  pushed and its kept blocks go. Answers `{request_id, status}`: `planned` (running: its
  final chunk reports the push), `sent` (it had finished: the push is done, with `kv_bytes`,
  `send_s` and any `kv_transfer_error`), `early` (not admitted yet: it will take this
  target) or `cancelled`.
- `GET /inference/v1/kv/info`: role, transport, mode and the KV address.

With `--kv-peers`, a generate request whose `kv_transfer_params` name any other KV peer
is refused (403, `kv_peer_not_registered`) before anything is dialled.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve.config import EngineRole, TransferConfig
from splitserve.engine.api.disconnect import CLIENT_GONE_STATUS, first_of
from splitserve.kv.connector.handoff_metrics import ForwardRegistry
from splitserve.kv.transport.nixl_package import NIXL_MISSING, load_nixl
from splitserve.protocol.errors import APIError
from splitserve.protocol.kv_transfer import (
    KV_TRANSFER_PARAMS,
    KVTransferParams,
    parse_kv_transfer_params,
)
from splitserve.runtime.http_edge import read_json_body

if TYPE_CHECKING:
    from splitserve.kv.connector.decode_side import DecodeConnector
    from splitserve.kv.connector.pd_base import PDConnector

MAX_RESERVE_WAIT_S = 120.0


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    transfer = TransferConfig()
    group = parser.add_argument_group("KV transfer (--role prefill|decode)")
    group.add_argument(
        "--kv-transport",
        choices=["shm", "tcp", "nixl", "auto"],
        default=None,
        help="default: shm when the KV cache is in CPU memory, tcp on a GPU; auto: per peer, "
        "shm with one on the same node (--kv-node-id), tcp with the others; nixl: one-sided "
        "NIXL (UCX) WRITEs and READs (pip install 'splitserve[nixl]')",
    )
    group.add_argument(
        "--kv-node-id",
        default=None,
        help="--kv-transport auto: the node this engine runs on (default: this host's boot ID)",
    )
    group.add_argument("--kv-mode", choices=["push", "pull"], default=transfer.mode)
    group.add_argument("--kv-port", type=int, default=0, help="KV socket port (default: a free one)")
    group.add_argument(
        "--kv-host", default=None, help="address the KV socket binds and peers dial (default: --host)"
    )
    group.add_argument(
        "--kv-peers",
        nargs="+",
        type=_peer_address,
        default=(),
        metavar="HOST:PORT",
        help="the KV peers (their --kv-host:--kv-port) this engine may dial; any other a "
        "request names is refused with 403 (`up` passes its engines'). Default: any",
    )
    group.add_argument(
        "--kv-timeout", type=float, default=transfer.timeout_s, help="seconds without progress"
    )
    group.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default=transfer.failure_policy)
    group.add_argument(
        "--kv-max-reservations",
        type=int,
        default=transfer.max_reservations,
        help="decode: requests waiting for remote KV at once (past it: 429)",
    )
    group.add_argument(
        "--kv-max-reserved-fraction",
        type=float,
        default=transfer.max_reserved_fraction,
        help="decode: share of the KV pool reservations may hold (past it: 429)",
    )
    group.add_argument(
        "--kv-reservation-ttl",
        type=float,
        default=transfer.reservation_ttl_s,
        help="seconds a reservation waits",
    )


def _peer_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def transfer_config(args: argparse.Namespace, device: str) -> TransferConfig:
    """The engine's KV transfer settings (ValueError: `--kv-transport nixl` without NIXL)."""
    if args.kv_transport == "nixl" and args.role in ("prefill", "decode"):
        try:
            load_nixl()
        except ImportError as exc:
            raise ValueError(f"--kv-transport nixl: {NIXL_MISSING}") from exc
    return TransferConfig(
        transport=args.kv_transport or ("shm" if device.startswith("cpu") else "tcp"),
        mode=args.kv_mode,
        timeout_s=args.kv_timeout,
        failure_policy=args.kv_failure_policy,
        reservation_ttl_s=args.kv_reservation_ttl,
        max_reservations=args.kv_max_reservations,
        max_reserved_fraction=args.kv_max_reserved_fraction,
        allowed_peers=tuple(args.kv_peers),
        node_id=args.kv_node_id,
    )


def check_kv_peer(connector: PDConnector, params: KVTransferParams | None) -> None:
    """Refuse (403) a request naming a KV peer not registered with the deployment: the
    engine never dials a host a request picks."""
    parsed = params or KVTransferParams()
    if parsed.remote_host is None and parsed.remote_port is None:
        return
    if not connector.transport.may_dial(str(parsed.remote_host), int(parsed.remote_port or 0)):
        raise APIError(
            403,
            f"KV peer {parsed.remote_host}:{parsed.remote_port} is not registered with this deployment",
            param=KV_TRANSFER_PARAMS,
            code="kv_peer_not_registered",
        )


def admit_generate(
    connector: PDConnector, decode: DecodeConnector | None, params: KVTransferParams | None
) -> None:
    """What a generate request's kv_transfer_params must pass before the engine takes it."""
    check_kv_peer(connector, params)
    if decode is not None:
        check_reservation_quota(decode, params)


def check_reservation_quota(connector: DecodeConnector, params: KVTransferParams | None) -> None:
    """Refuse (429, `Retry-After`) a request that would wait for remote KV while decode
    already holds its limit of reservations, so no caller can pin the whole cache."""
    if params is None or not params.do_remote_prefill:
        return
    config, table = connector.config, connector.reservations
    pool = connector.transport.pool
    num_blocks = pool.shape[2] if pool is not None else 0
    if table.active() >= config.max_reservations or (
        num_blocks and table.reserved_blocks() >= config.max_reserved_fraction * num_blocks
    ):
        raise APIError(
            429,
            f"decode holds its limit of KV reservations ({table.active()} requests, "
            f"{table.reserved_blocks()} of {num_blocks} blocks); retry later",
            code="kv_reservations_full",
            retry_after_s=1,
        )


def make_connector(
    role: EngineRole, transfer: TransferConfig, host: str, kv_port: int = 0
) -> PDConnector | None:
    """The P/D connector for a prefill or decode engine; None for a collocated one."""
    if role == "both":
        return None
    from splitserve.kv.connector.pd_connector import make_pd_connector  # torch: only engines pay for it

    return make_pd_connector(role, transfer, host=host, port=kv_port)


async def _wait_reserved(connector: DecodeConnector, request_id: str, timeout_s: float):
    """The request's reservation, awaited on the event loop (the engine thread adds it)."""
    found = connector.reservations.get(request_id)
    if found is not None:
        return found
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def reserved(reservation) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(reservation))

    connector.reservations.on_reserved(request_id, reserved)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        return None
    finally:
        connector.reservations.forget_callbacks(request_id)


def install_kv_routes(app: FastAPI, connector: PDConnector) -> None:
    """Add the KV endpoints and forward the handoff metrics into the app's `/metrics`."""
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.registry.register(ForwardRegistry(connector.metrics.registry))
    from splitserve.kv.connector.decode_side import DecodeConnector
    from splitserve.kv.connector.prefill_side import PrefillConnector

    decode = connector if isinstance(connector, DecodeConnector) else None
    prefill = connector if isinstance(connector, PrefillConnector) else None
    app.state.kv_connector = connector
    engine = getattr(app.state, "engine", None)
    if engine is not None:
        connector.set_abort(engine.abort)  # failure_policy "fail" ends the request
    app.state.admit_generate = lambda params: admit_generate(connector, decode, params)

    async def request_id_of(raw: Request) -> tuple[str, dict]:
        body = await read_json_body(raw, 64 * 1024)
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise APIError(400, "request_id must be a non-empty string", param="request_id")
        return request_id, body

    @app.post("/inference/v1/kv/reserve")
    async def reserve(raw: Request) -> Response:
        if decode is None:
            raise APIError(
                400, f"this engine's role is {connector.role}; reservations live on decode workers"
            )
        request_id, body = await request_id_of(raw)
        timeout = body.get("timeout_s", 30.0)
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not 0 <= timeout <= MAX_RESERVE_WAIT_S
        ):
            raise APIError(
                400, f"timeout_s must be a number in [0, {MAX_RESERVE_WAIT_S:.0f}]", param="timeout_s"
            )
        # A caller that leaves stops the wait (the proxy's request ended: refused with a
        # 429, its client gone), instead of holding this request, and a drain, to the timeout.
        gone, reservation = await first_of(_wait_reserved(decode, request_id, float(timeout)), raw.receive)
        if gone:
            return Response(status_code=CLIENT_GONE_STATUS)
        if reservation is None:
            raise APIError(
                404, f"request {request_id!r} reserved no blocks within {timeout}s", param="request_id"
            )
        where = KVTransferParams(
            transfer_mode="push",
            remote_request_id=request_id,
            remote_block_ids=tuple(reservation.block_ids),
            remote_first_block=reservation.first_block,
            remote_num_tokens=reservation.num_tokens,
            prefix_lend_id=reservation.lend_id,
            prefix_block_ids=reservation.lent_block_ids or None,
            prefix_block_hashes=reservation.lent_block_hashes or None,
        ).with_address(connector.kv_address())
        cached = reservation.num_cached_tokens
        return JSONResponse({"request_id": request_id, **where.to_wire(), "num_cached_tokens": cached})

    @app.post("/inference/v1/kv/transfer_failed")
    async def transfer_failed(raw: Request) -> JSONResponse:
        request_id, body = await request_id_of(raw)
        error = str(body.get("error") or "the prefill worker reported a failure")
        return JSONResponse({"request_id": request_id, "failed": connector.fail_transfer(request_id, error)})

    @app.post("/inference/v1/kv/release_hold")
    async def release_hold(raw: Request) -> JSONResponse:
        request_id, _ = await request_id_of(raw)
        released = prefill is not None and prefill.release_hold(request_id)
        return JSONResponse({"request_id": request_id, "released": released})

    @app.post("/inference/v1/kv/push_target")
    async def push_target(raw: Request) -> JSONResponse:
        if prefill is None:
            raise APIError(400, f"this engine's role is {connector.role}; push targets go to prefill workers")
        request_id, body = await request_id_of(raw)
        params = parse_kv_transfer_params(body)
        if params is None:
            return JSONResponse(
                {
                    "request_id": request_id,
                    "status": "cancelled",
                    "cancelled": prefill.pusher.cancel(request_id),
                }
            )
        check_kv_peer(connector, params)
        answer = await asyncio.to_thread(prefill.pusher.set_target, request_id, params)
        report: dict = {"request_id": request_id, "status": answer.status}
        if answer.outcome is not None:
            sent = KVTransferParams(
                kv_bytes=answer.outcome.num_bytes,
                state_bytes=answer.outcome.state_bytes or None,
                send_s=answer.outcome.send_s,
                kv_transfer_error=answer.outcome.error,
            )
            report.update(sent.to_wire())
        return JSONResponse(report)

    @app.get("/inference/v1/kv/info")
    async def info() -> JSONResponse:
        return JSONResponse(
            {
                "role": connector.role,
                "transport": connector.config.transport,
                "mode": connector.config.mode,
                "failure_policy": connector.config.failure_policy,
                "pid": os.getpid(),
                "received_bytes": connector.transport.received_by_path(),  # auto: per data path
                # a hybrid model's Mamba states, counted apart from the KV (0 without one)
                "state_bytes": {
                    "per_request": connector.state_bytes,
                    "sent": connector.transport.sent.state_bytes,
                    "received": connector.transport.arrivals.state_bytes_received,
                },
                **KVTransferParams().with_address(connector.kv_address()).to_wire(),
            }
        )
