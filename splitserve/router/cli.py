"""`splitserve proxy --render URL... --prefill URL... --decode URL...`: the P/D proxy."""

from __future__ import annotations

import argparse
import logging
import sys

from splitserve.router.routing import RoutingPolicy
from splitserve.runtime import access
from splitserve.runtime.client_quota import QUOTA_BY, ClientQuota, QuotaLimits
from splitserve.runtime.drain import add_serving_arguments, serve_draining
from splitserve.runtime.http_edge import DEFAULT_MAX_BODY_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--render", nargs="+", required=True, help="render tier base URLs (replicas share --state-key)"
    )
    parser.add_argument("--prefill", nargs="*", default=[], help="prefill worker base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode worker base URLs")
    parser.add_argument(
        "--encoder", nargs="*", default=[], help="encoder worker base URLs (images encoded once, by hash)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mode", choices=["push", "pull"], default="push", help="KV transfer mode")
    parser.add_argument(
        "--kv-bidirectional",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="push: prefill pulls the leading blocks the decode worker holds (by block hash) "
        "instead of computing them",
    )
    parser.add_argument(
        "--pd-decision",
        choices=["cost", "threshold"],
        default="cost",
        help="which prompts go through the prefill pool: cost (per request, whichever path costs "
        "the system less: uncached tokens, decode's streams and queue, the prefill queue, the "
        "deployment's costs) or threshold (--min-prefill-tokens uncached tokens and up)",
    )
    parser.add_argument(
        "--pd-cost-profile",
        default=None,
        metavar="FILE",
        help="JSON of the cost decision's numbers (docs/pd.md; `splitserve sim calibrate "
        "--engine URL --save FILE` writes one); the fields it names are not measured",
    )
    parser.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=64,
        help="--pd-decision threshold: prompts with fewer uncached tokens skip the prefill pool",
    )
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument(
        "--reserve-timeout", type=float, default=30.0, help="seconds to wait for a reservation"
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=5.0,
        help="seconds a decode stream may be silent before its worker's /health is probed; "
        "a worker that does not answer is stalled and its streams move to another decode worker",
    )
    parser.add_argument(
        "--resume-wait",
        type=float,
        default=60.0,
        help="seconds a stream whose decode worker failed may wait for a decode worker to come "
        "(back) into rotation when no other is available, before it ends with 503 (0: at once)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="request body limit"
    )
    access.add_public_arguments(parser)
    access.add_internal_arguments(parser)
    parser.add_argument(
        "--max-in-flight-per-client",
        type=int,
        default=0,
        help="chat/completions requests one client (see --quota-by) may have in flight (each "
        "holds at most one KV reservation); past it: 429 with Retry-After. Default 0: no bound",
    )
    parser.add_argument(
        "--max-kv-blocks-per-client",
        type=int,
        default=0,
        help="KV blocks the prompts of one client's running requests may take on decode "
        "(ceil(prompt tokens / block size) each); past it: 429 with Retry-After. Default 0: no bound",
    )
    parser.add_argument(
        "--quota-by",
        nargs="+",
        choices=QUOTA_BY,
        default=["address"],
        help="what a client of the per-client bounds is: its address, its API key (hashed), "
        "or both (each bound applies to each). Default: address",
    )
    parser.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=1.0,
        help="routing cost per prompt block a worker would prefill (its cached prefix is free)",
    )
    parser.add_argument(
        "--kv-prefill-load-weight",
        type=float,
        default=1.0,
        help="routing cost per block of prompt tokens queued for prefill on a worker",
    )
    parser.add_argument(
        "--kv-decode-load-weight",
        type=float,
        default=0.1,
        help="routing cost per KV block held by a worker's decoding requests",
    )
    parser.add_argument(
        "--kv-load-weight", type=float, default=0.0, help="routing cost per request a worker has in flight"
    )
    parser.add_argument(
        "--kv-store",
        default=None,
        metavar="URL",
        help="a `splitserve kvstore`'s HTTP URL: cache-aware routing credits the blocks it holds "
        "(its KV events), below a worker's own",
    )
    parser.add_argument(
        "--kv-store-ram-credit",
        type=float,
        default=0.75,
        help="what a block the KV store holds in RAM is worth beside a cached one (1)",
    )
    parser.add_argument(
        "--kv-store-disk-credit",
        type=float,
        default=0.25,
        help="what a block the KV store holds on disk is worth beside a cached one (1)",
    )
    parser.add_argument(
        "--load-interval",
        type=float,
        default=0.25,
        help="seconds between polls of each worker's load (queued prefill tokens, decode blocks)",
    )
    parser.add_argument(
        "--routing",
        choices=[str(p) for p in RoutingPolicy],
        default=str(RoutingPolicy.CACHE_AWARE),
        help="how each pool's worker is picked: cache-aware (KV event index vs load), "
        "least-loaded, round-robin, text-prefix (longest common prefix of the client's text)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_serving_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from splitserve.protocol.pd_decision import load_cost_profile
    from splitserve.router.app import create_proxy_app
    from splitserve.router.kv_index import KVRoutingWeights
    from splitserve.router.pd_engine_client import PDEngineClient
    from splitserve.router.pd_policy import PDPolicy
    from splitserve.router.workers import WorkerPool

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        policy = PDPolicy(
            args.min_prefill_tokens,
            args.mode,
            args.reserve_timeout,
            args.stall_timeout,
            bidirectional=args.kv_bidirectional,
            resume_wait_s=args.resume_wait,
            decision=args.pd_decision,
        )
        cost_profile = load_cost_profile(args.pd_cost_profile) if args.pd_cost_profile else None
        pool = WorkerPool(args.prefill, args.decode)
        weights = KVRoutingWeights(
            overlap_weight=args.kv_overlap_weight,
            prefill_load_weight=args.kv_prefill_load_weight,
            decode_load_weight=args.kv_decode_load_weight,
            load_weight=args.kv_load_weight,
            store_ram_credit=args.kv_store_ram_credit,
            store_disk_credit=args.kv_store_disk_credit,
        )
        access.load_internal_token(args)  # every client to the internal parts sends it
        quota = QuotaLimits(
            args.max_in_flight_per_client, args.max_kv_blocks_per_client, tuple(dict.fromkeys(args.quota_by))
        )
        public = access.public_policy(args)
        if "api-key" in quota.by and not public.keys:
            raise ValueError("--quota-by api-key needs --api-key (or $SPLITSERVE_API_KEY)")
    except (OSError, ValueError) as exc:
        print(f"splitserve proxy: {exc}", file=sys.stderr)
        return 2
    for flag, interval in (
        ("--health-interval", args.health_interval),
        ("--load-interval", args.load_interval),
    ):
        if not interval > 0:
            print(f"splitserve proxy: {flag} must be positive", file=sys.stderr)
            return 2
    app = create_proxy_app(
        args.render,
        PDEngineClient(
            pool,
            policy,
            routing_weights=weights,
            routing=RoutingPolicy(args.routing),
            cost_profile=cost_profile,
        ),
        health_interval_s=args.health_interval,
        load_interval_s=args.load_interval,
        max_body_bytes=args.max_body_bytes,
        encoder_urls=args.encoder,
        kv_store_url=args.kv_store,
    )
    serve_draining(
        access.AccessGuard(ClientQuota(app, quota), public),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        drain_timeout_s=args.drain_timeout,
        max_in_flight=args.max_in_flight,
    )
    return 0
