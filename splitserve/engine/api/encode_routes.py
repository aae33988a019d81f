"""The encoder cache on the engine's command line and HTTP surface.

Flags (any role): where the encoder cache lives (`--ec-shm-dir`: a tmpfs directory shared
by the processes of one host; `--ec-remote HOST:PORT`: another host's `ECServer`), an
optional `ECServer` for other hosts (`--ec-serve-port`), this engine's own encoder-cache
size and the byte limit on a request's decoded pixels.

`splitserve engine --role encoder` runs only the vision tower (`EncoderWorker`) behind
`POST /inference/v1/encode`:

    {"request_id"?: str, "features": <the render tier's features, with pixels>}
    -> {"request_id", "ec_transfer_params": {"mm_hashes": [...], "num_tokens": [...],
                                             "cached": [...]},
        "metrics": {"encode_ms": float}}

Each image is encoded unless the encoder cache already holds its hash, and published to
the cache, where prefill/decode engines sharing it load it by hash.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.config import CacheConfig
from splitserve.engine.api.mm_metrics import EncoderWorkerCollector
from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import DEFAULT_MAX_PIXEL_BYTES, parse_features
from splitserve.runtime import access
from splitserve.runtime.http_edge import install_error_handlers, read_json_body
from splitserve.runtime.http_pool import SERVER_KEEPALIVE_S

if TYPE_CHECKING:  # torch: imported when an engine or encoder is built, not for --help
    from splitserve.encoder_cache.connector import ECConnector
    from splitserve.encoder_cache.tcp import ECServer
    from splitserve.engine.encoder_worker import EncoderJob, EncoderWorker

ENCODE_PATH = "/inference/v1/encode"


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def add_ec_arguments(parser: argparse.ArgumentParser, memory_size: Callable[[str], int]) -> None:
    """`memory_size` parses '512MiB' (the engine CLI's parser)."""
    parser.add_argument(
        "--ec-shm-dir",
        default=None,
        help="encoder cache shared by this host's processes (a tmpfs directory); with "
        "--role encoder the default is a directory under /dev/shm",
    )
    parser.add_argument(
        "--ec-remote",
        type=_host_port,
        default=None,
        metavar="HOST:PORT",
        help="reach another host's encoder cache (its --ec-serve-port) instead of a local one",
    )
    parser.add_argument(
        "--ec-serve-port",
        type=int,
        default=None,
        help="serve this host's --ec-shm-dir to other hosts on this port (bound to --host)",
    )
    parser.add_argument(
        "--encoder-cache-memory",
        type=memory_size,
        default=CacheConfig().encoder_cache_bytes,
        help="this engine's own cache of visual-token embeddings (default 512MiB)",
    )
    parser.add_argument(
        "--max-pixel-bytes",
        type=memory_size,
        default=DEFAULT_MAX_PIXEL_BYTES,
        help="decoded image pixels per request (413 past it; default 64MiB)",
    )


class ECSetup:
    """The encoder-cache connector the flags ask for, and the server they may start."""

    def __init__(self, args: argparse.Namespace, encoder_role: bool) -> None:
        from splitserve.encoder_cache.connector import SharedMemoryECConnector, default_shm_directory
        from splitserve.encoder_cache.tcp import ECServer, TcpECConnector

        self.connector: ECConnector | None = None
        self.server: ECServer | None = None
        token = access.internal_token()  # the deployment's: the cache server answers only it
        if args.ec_remote is not None:
            self.connector = TcpECConnector(*args.ec_remote, token=token)
        elif args.ec_shm_dir is not None or encoder_role:
            self.connector = SharedMemoryECConnector(args.ec_shm_dir or default_shm_directory())
        if args.ec_serve_port is not None:
            if not isinstance(self.connector, SharedMemoryECConnector):
                raise ValueError("--ec-serve-port serves a local cache: give --ec-shm-dir")
            self.server = ECServer(self.connector, host=args.host, port=args.ec_serve_port, token=token)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def jobs_from_body(body: Any, max_pixel_bytes: int) -> tuple[str, list[EncoderJob]]:
    """(request ID, one job per image) of an encode body; APIError 400/413."""
    from splitserve.engine.encoder_worker import EncoderJob

    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - {"request_id", "features"})
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
    request_id = body.get("request_id") or f"enc-{time.monotonic_ns()}"
    if not isinstance(request_id, str):
        raise APIError(400, "request_id must be a string", param="request_id")
    images = parse_features(body.get("features"), max_pixel_bytes)
    if not images:
        raise APIError(400, "features must name at least one image", param="features")
    if any(image.pixel_values is None for image in images):
        raise APIError(400, "the encoder needs every image's pixel_values", param="features")
    return request_id, [EncoderJob(i.image_hash, i.grid_thw, i.pixel_values) for i in images]


def create_encoder_app(worker: EncoderWorker, max_pixel_bytes: int = DEFAULT_MAX_PIXEL_BYTES) -> FastAPI:
    """The encoder role's API. Encoding runs on one worker thread: one batch at a time,
    never on the event loop."""
    lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            worker.ec_connector.shutdown()

    registry = CollectorRegistry()
    registry.register(EncoderWorkerCollector(worker))
    app = FastAPI(title="splitserve encoder", lifespan=lifespan)
    app.state.encoder = worker
    install_error_handlers(app)
    body_limit = 2**20 + max_pixel_bytes * 4 // 3  # base64 pixels plus the JSON around them

    @app.post(ENCODE_PATH)
    async def encode(raw_request: Request) -> JSONResponse:
        request_id, jobs = jobs_from_body(await read_json_body(raw_request, body_limit), max_pixel_bytes)
        start = time.perf_counter()
        async with lock:
            results = await asyncio.to_thread(worker.encode, jobs)
        params = {
            "mm_hashes": [r.image_hash for r in results],
            "num_tokens": [r.num_tokens for r in results],
            "cached": [r.cached for r in results],
        }
        metrics = {"encode_ms": (time.perf_counter() - start) * 1e3}
        return JSONResponse({"request_id": request_id, "ec_transfer_params": params, "metrics": metrics})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def run_encoder(args: argparse.Namespace, model_dir: str) -> int:
    """`splitserve engine --role encoder`: the vision tower behind the encode API."""
    import uvicorn

    from splitserve.engine.encoder_worker import EncoderWorker

    try:
        ec = ECSetup(args, encoder_role=True)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"splitserve engine: {exc}") from exc
    assert ec.connector is not None
    dtype = None if args.dtype == "auto" else args.dtype
    try:
        worker = EncoderWorker(model_dir, ec.connector, dtype=dtype, device=args.device)
    except (ValueError, KeyError, OSError) as exc:
        ec.close()
        raise SystemExit(f"splitserve engine: --role encoder needs a vision-language model: {exc}") from exc
    app = access.AccessGuard(create_encoder_app(worker, args.max_pixel_bytes), access.internal_policy(args))
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=SERVER_KEEPALIVE_S,
        )
    finally:
        ec.close()
    return 0
