"""`splitserve engine [MODEL]`: serve the token-in/token-out engine API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import re

from splitserve.config import (
    KV_CACHE_DTYPES,
    AfdConfig,
    CacheConfig,
    CpuLendingConfig,
    EngineConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
)
from splitserve.engine.api import encode_routes, kv_routes, kv_store_setup
from splitserve.runtime import access
from splitserve.runtime.drain import add_serving_arguments, serve_draining

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_memory_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 512MiB, 2GiB)")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    return size


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {'positive' if least > 0 else 'zero or more'}: {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, 1)


def _non_negative_int(text: str) -> int:
    return _integer(text, 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cache, scheduler = CacheConfig(), SchedulerConfig()
    parser.add_argument(
        "model", nargs="?", default=None, help="GGUF file, model directory or HF ID (default: the demo model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--role",
        choices=["both", "prefill", "decode", "encoder", "attention", "ffn"],
        default="both",
        help="attention: a MoE model's experts run on the FFN daemon at --ffn-address; "
        "ffn: that daemon (the experts only, on --port; no HTTP API, no scheduler, no KV)",
    )
    parser.add_argument(
        "--ffn-address", default=None, help="--role attention (or decode): the FFN daemon's HOST:PORT"
    )
    parser.add_argument(
        "--ffn-combine-engines",
        action="store_true",
        help="--role ffn: compute the requests of several attention engines for one layer as "
        "one batch (fewer, larger matmuls; a row's rounding then depends on the other engines' "
        "rows, so their tokens may differ from a collocated engine's)",
    )
    parser.add_argument(
        "--ffn-timeout", type=float, default=30.0, help="seconds for the FFN daemon's answer to one layer"
    )
    parser.add_argument(
        "--afd-microbatches",
        type=int,
        choices=[1, 2],
        default=1,
        help="with --ffn-address: 2 runs a decode step of >= 2 sequences as 2 micro-batches, "
        "one's FFN traffic hidden behind the other's attention; 1 (the default: faster on "
        "shared CPU cores, docs/afd.md) the whole step at once",
    )
    parser.add_argument(
        "--afd-transport",
        choices=["shm", "tcp", "auto"],
        default="auto",
        help="with --ffn-address: a layer's tensors through shared memory (the daemon on this "
        "host), as tcp frames, or auto (the default): shm when the daemon can map it, else tcp",
    )
    parser.add_argument("--block-size", type=_positive_int, default=cache.block_size)
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=cache.kv_cache_memory_bytes,
        help="KV cache budget, e.g. 512MiB or 2GiB (default 512MiB)",
    )
    parser.add_argument("--num-blocks", type=_positive_int, default=None, help="overrides --kv-cache-memory")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--state-cache-memory",
        type=parse_memory_size,
        default=cache.state_cache_bytes,
        help="hybrid (Mamba) models: budget of the running requests' states (default 512MiB; "
        "at most --max-num-seqs of them)",
    )
    parser.add_argument(
        "--state-snapshot-memory",
        type=parse_memory_size,
        default=cache.state_snapshot_bytes,
        help="hybrid (Mamba) models: budget of the state snapshots prefix hits resume from "
        "(default 64MiB; --no-prefix-caching turns them off)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=_positive_int, default=scheduler.max_num_batched_tokens
    )
    parser.add_argument("--max-num-seqs", type=_positive_int, default=scheduler.max_num_seqs)
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=_non_negative_int,
        default=scheduler.long_prefill_token_threshold,
        help="a prompt computes at most this many tokens in a step that carries decodes, so "
        "streams stall one chunk at a time (0: no cap)",
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="default: the model's max_position_embeddings",
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=cache.kv_cache_dtype,
        help="the KV cache's element type (default auto: the compute dtype); under float32 "
        "activations (a GGUF file served quantized) float16 halves the bytes decode attention "
        "reads, as llama.cpp's f16 cache",
    )
    parser.add_argument(
        "--quantization",
        choices=["auto", "gguf", "none"],
        default="auto",
        help="gguf: a GGUF file's Q8_0/Q4_0/Q4_1 projections stay quantized (int8 kernels); "
        "none: dequantized to --dtype; auto (default): gguf for a GGUF file unless --dtype is named",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serial-step-tokens",
        type=_non_negative_int,
        default=ModelConfig.serial_step_tokens,
        help="CPU: steps of at most this many tokens run on one thread, larger ones on all "
        "(0: every step on all threads)",
    )
    parser.add_argument(
        "--lend-idle-cpus",
        metavar="FILE",
        default=None,
        help="lend this engine's CPUs to the engines borrowing through FILE while it has nothing "
        "to compute (`up` with pinned engines sets it on decode)",
    )
    parser.add_argument(
        "--borrow-idle-cpus",
        metavar="FILE",
        nargs="+",
        default=[],
        help="run large steps on the CPUs of the lenders behind these files too while they are "
        "idle (`up` with pinned engines sets it on prefill)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per engine step (its time, tokens, batch, thread CPU) to FILE",
    )
    add_serving_arguments(parser)
    kv_routes.add_kv_arguments(parser)  # P/D roles: transport, mode, timeouts
    encode_routes.add_ec_arguments(parser, parse_memory_size)  # images: encoder cache, limits
    access.add_internal_arguments(parser)
    kv_store_setup.add_kv_store_arguments(parser)  # --kv-store: offload to and load from the store tier
    parser.add_argument(
        "--kv-retention-ttl",
        type=float,
        default=None,
        help="seconds a finished request's cached blocks stay prefix hits (released early under "
        "memory pressure; default: 480 on a decode worker, until reused otherwise; 0: until reused)",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV cache events (vLLM's KVEventBatch, msgpack over ZMQ PUB) here, e.g. tcp://*:5557",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint answering replay requests (default: the events endpoint's port + 1)",
    )


DECODE_RETENTION_TTL_S = 480.0  # vLLM's decoder_kv_blocks_ttl


def retention_ttl(args: argparse.Namespace) -> float | None:
    if args.kv_retention_ttl is not None and args.kv_retention_ttl < 0:
        raise ValueError(f"--kv-retention-ttl must be >= 0, not {args.kv_retention_ttl}")
    if args.kv_retention_ttl is None:
        return DECODE_RETENTION_TTL_S if args.role == "decode" else None
    return args.kv_retention_ttl or None


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    if not args.kv_events_endpoint:
        return None
    from splitserve.protocol.kv_events import replay_endpoint_for

    replay = args.kv_events_replay_endpoint or replay_endpoint_for(args.kv_events_endpoint)
    return KVEventsConfig(endpoint=args.kv_events_endpoint, replay_endpoint=replay)


def engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    """The engine's config; the device and, when not named, the KV transport are decided
    here: shm for a CPU KV cache, tcp for a GPU one (ValueError for shm on a GPU)."""
    from splitserve.engine.device import default_device  # torch: only engines pay for it

    device = args.device or str(default_device())
    return EngineConfig(
        model=ModelConfig(
            model=model_dir,
            dtype=None if args.dtype == "auto" else args.dtype,
            quantization=args.quantization,
            device=device,
            seed=args.seed,
            serial_step_tokens=args.serial_step_tokens,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            num_blocks=args.num_blocks,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=not args.no_prefix_caching,
            encoder_cache_bytes=args.encoder_cache_memory,
            state_cache_bytes=args.state_cache_memory,
            state_snapshot_bytes=args.state_snapshot_memory,
            retention_ttl_s=retention_ttl(args),
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
        role="both" if args.role == "attention" else args.role,
        transfer=kv_routes.transfer_config(args, device),
        kv_events=kv_events_config(args),
        afd=afd_config(args),
        cpu_lending=CpuLendingConfig(args.lend_idle_cpus, tuple(args.borrow_idle_cpus)),
    )


def afd_config(args: argparse.Namespace) -> AfdConfig | None:
    """The FFN daemon of --role attention, or of a decode engine given --ffn-address (the
    attention side behind P/D: `up --afd`); ValueError without a valid --ffn-address."""
    if args.role == "decode" and args.ffn_address is None:
        return None
    if args.role not in ("attention", "decode"):
        if args.ffn_address is not None:
            raise ValueError("--ffn-address needs --role attention or decode")
        return None
    host, _, port = (args.ffn_address or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--role attention needs --ffn-address HOST:PORT, not {args.ffn_address!r}")
    if args.ffn_timeout <= 0:
        raise ValueError(f"--ffn-timeout must be positive, not {args.ffn_timeout}")
    return AfdConfig(host, int(port), args.ffn_timeout, args.afd_microbatches, args.afd_transport)


def run(args: argparse.Namespace) -> int:
    from splitserve.afd.ffn_connection import AfdError
    from splitserve.engine.api.app import create_engine_app
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.engine.step_log import attach_step_log
    from splitserve.model_files.resolve import resolve_model_or_exit

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.role == "encoder":
        return encode_routes.run_encoder(args, resolve_model_or_exit(args.model).path)
    if args.role == "ffn":
        from splitserve.afd.ffn_server import run_ffn

        return run_ffn(args, resolve_model_or_exit(args.model).path)
    try:
        policy = access.internal_policy(args)
        config = engine_config(args, resolve_model_or_exit(args.model).path)
        ec = encode_routes.ECSetup(args, encoder_role=False)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"splitserve engine: {exc}") from exc
    kv_host = args.kv_host or args.host
    pd_connector = kv_routes.make_connector(config.role, config.transfer, kv_host, args.kv_port)
    try:  # the KV store tier: it loads into the prefix cache, beside any connector
        kv_store = kv_store_setup.make_kv_store_client(args, config, access.internal_token())
    except ValueError as exc:
        ec.close()
        raise SystemExit(f"splitserve engine: {exc}") from exc
    try:
        engine = AsyncEngine(config, connector=pd_connector, ec_connector=ec.connector, kv_store=kv_store)
    except (ValueError, AfdError) as exc:  # what the model, the memory or the FFN daemon cannot take
        ec.close()
        raise SystemExit(f"splitserve engine: {exc}") from exc
    try:
        attach_step_log(args.step_log, engine, config.role)
    except OSError as exc:
        engine.shutdown()
        ec.close()
        raise SystemExit(f"splitserve engine: --step-log: {exc}") from exc
    app = create_engine_app(engine, manage_engine=True, max_pixel_bytes=args.max_pixel_bytes)
    if pd_connector is not None:
        kv_routes.install_kv_routes(app, pd_connector)
    kv_store_setup.install_kv_store(app, kv_store)
    if config.kv_events is not None:
        from splitserve.engine.api.kv_events_route import install_kv_events_route

        install_kv_events_route(app, config.kv_events, config.cache.block_size)
    if pd_connector is not None and not policy.keys:
        logging.getLogger(__name__).warning(
            "no internal token (%s or --internal-token-file): every local user can write "
            "into this engine's KV cache; `splitserve up` always sets one",
            access.INTERNAL_TOKEN_ENV,
        )
    guarded = access.AccessGuard(app, policy)
    try:
        serve_draining(
            guarded,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            drain_timeout_s=args.drain_timeout,
            max_in_flight=args.max_in_flight,
        )
    finally:
        ec.close()
    return 0
