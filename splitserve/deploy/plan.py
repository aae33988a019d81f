"""The deployment plan: every tier's `splitserve` command line and the secrets its processes
get, built once from `up`'s flags (or a Ray YAML config) and consumed by both launchers.

A tier's argv here holds only what every replica of the tier shares. What depends on
where a replica lands is the launcher's: `up` (`deploy/up_cli.py`) adds the host, the ports
it picked, the KV peers and the encoder cache's directory; a Ray replica
(`ray_serve/tier.py`) adds its node's address, ports, node ID and the way to the encoder
cache. Secrets travel by name: a launcher puts their values in the process's environment,
never on a command line (which every user of the host can read).
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass

from splitserve.frontend.media_cli import media_flags
from splitserve.frontend.stream_state import STATE_KEY_ENV
from splitserve.runtime.access import API_KEY_ENV, INTERNAL_TOKEN_ENV

SERVER_TIERS = ("render", "prefill", "decode", "encoder")  # what both launchers start
KV_ROLES = ("prefill", "decode")  # the engines that move KV (and publish KV events)
FFN_ROLE = "ffn"  # `up --afd A:F`: the FFN daemons the decode (attention) engines call per MoE layer
STORE_ROLE = "kvstore"  # `up --kv-store`: the KV store tier the P/D engines offload to and load from


@dataclass(frozen=True)
class TierPlan:
    """One tier: the command line its replicas share, and the secrets they get."""

    role: str  # render, prefill, decode, encoder, ffn or proxy
    argv: tuple[str, ...]  # `splitserve` arguments, with no host, port or peer on it
    secret_names: tuple[str, ...]  # environment variables its processes get from the deployment

    @property
    def moves_kv(self) -> bool:
        """Whether its replicas need a KV socket and the two KV-event endpoints too."""
        return self.role in KV_ROLES


@dataclass(frozen=True)
class DeploymentPlan:
    """The tiers in the order `up` starts them (the proxy last, once the others serve), and
    how many replicas each runs. Ray takes the server tiers only: its proxy is the
    in-process ingress, and its replica counts are the config's (they may autoscale)."""

    tiers: tuple[TierPlan, ...]
    replicas: tuple[tuple[str, int], ...]

    def tier(self, role: str) -> TierPlan:
        for tier in self.tiers:
            if tier.role == role:
                return tier
        raise KeyError(role)

    def count(self, role: str) -> int:
        return dict(self.replicas).get(role, 0)

    def part_names(self) -> list[str]:
        return part_names(self.replicas)


def up_replicas(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """Each tier's replica count from `up`'s flags, in start order (the proxy last; the
    FFN daemons of `--afd` before the engines)."""
    ffn = ((FFN_ROLE, args.afd[1]),) if getattr(args, "afd", None) else ()
    store = ((STORE_ROLE, 1),) if getattr(args, "kv_store", False) else ()
    return (
        ("render", args.render), *store, *ffn, ("prefill", args.prefill), ("decode", args.decode),
        ("encoder", args.encoder), ("proxy", 1),
    )  # fmt: skip


def part_names(replicas: tuple[tuple[str, int], ...]) -> list[str]:
    """The names `up` gives its parts, in start order: `render` alone, else `render-0`,
    ...; `kvstore`; engines `ROLE-INDEX`; `proxy`."""
    names: list[str] = []
    for role, count in replicas:
        if role in ("render", STORE_ROLE, "proxy") and count == 1:
            names.append(role)
        else:
            names += [f"{role}-{index}" for index in range(count)]
    return names


def render_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The render tier's flags from `up`'s (local or on Ray)."""
    flags = [
        "--reasoning-parser", args.reasoning_parser, "--tool-call-parser", args.tool_call_parser,
        "--max-body-bytes", str(args.max_body_bytes), "--drain-timeout", str(args.drain_timeout),
        *media_flags(args),
    ]  # fmt: skip
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.trust_request_chat_template:
        flags.append("--trust-request-chat-template")
    return tuple(flags)


def engine_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags every engine gets from `up`'s, local or on Ray (the KV transport and mode
    are the plan's: Ray may pick the transport by placement)."""
    flags: list[str] = ["--drain-timeout", str(args.drain_timeout)]
    for flag, value in (
        ("--num-blocks", args.num_blocks),
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--max-model-len", args.max_model_len),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--long-prefill-token-threshold", args.long_prefill_token_threshold),
        ("--dtype", args.dtype),
        ("--kv-cache-dtype", args.kv_cache_dtype),
        ("--quantization", args.quantization),
        ("--kv-timeout", args.kv_timeout),
        ("--kv-reservation-ttl", args.kv_reservation_ttl),
        ("--afd-microbatches", getattr(args, "afd_microbatches", None)),  # read with --ffn-address only
        ("--afd-transport", getattr(args, "afd_transport", None)),
        ("--step-log", args.step_log and os.path.abspath(args.step_log)),  # parts' own working folders
    ):
        if value is not None:
            flags += [flag, str(value)]
    flags += ["--max-pixel-bytes", str(args.max_pixel_bytes_per_request)]  # the render's limit
    return tuple(flags)


def proxy_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The local proxy's flags from `up`'s (on Ray, the ingress takes its own few)."""
    flags = [
        "--mode", args.mode, "--min-prefill-tokens", str(args.min_prefill_tokens),
        "--log-level", args.log_level, "--max-body-bytes", str(args.max_body_bytes),
        "--drain-timeout", str(args.drain_timeout), "--max-in-flight", str(args.max_in_flight),
    ]  # fmt: skip
    if args.open_health_metrics:
        flags.append("--open-health-metrics")
    if not args.kv_bidirectional:
        flags.append("--no-kv-bidirectional")
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
            flags += [flag, str(value)]
    if args.quota_by:
        flags += ["--quota-by", *args.quota_by]
    return tuple(flags)


def store_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The KV store tier's flags from `up`'s; ValueError for sizes it cannot take."""
    sizes = store_size_flags(args.kv_store_ram_gb, args.kv_store_disk, args.kv_store_disk_gb)
    return (*sizes, "--drain-timeout", str(args.drain_timeout))


def store_size_flags(ram_gb: float, disk: str | None, disk_gb: float | None) -> tuple[str, ...]:
    """The KV store's RAM and disk tiers as its flags (local or on Ray); ValueError for
    sizes it cannot take, naming `up`'s flag."""
    if (disk is None) != (disk_gb is None):
        raise ValueError("--kv-store-disk and --kv-store-disk-gb go together")
    for flag, value in (("--kv-store-ram-gb", ram_gb), ("--kv-store-disk-gb", disk_gb)):
        if value is not None and not 0 < value < float("inf"):  # also NaN
            raise ValueError(f"{flag} must be a positive size in GiB, not {value}")
    flags = ["--kv-store-ram-gb", str(ram_gb)]
    if disk is not None:
        flags += ["--kv-store-disk", os.path.abspath(disk), "--kv-store-disk-gb", str(disk_gb)]
    return tuple(flags)


def store_tier(log_level: str, flags: tuple[str, ...]) -> TierPlan:
    """The KV store tier: one process, torch-free; the host and ports the launcher's."""
    return TierPlan(STORE_ROLE, (STORE_ROLE, "--log-level", log_level, *flags), (INTERNAL_TOKEN_ENV,))


def server_tiers(
    *,
    model: str | None,
    served_model_name: str | None,
    log_level: str,
    mode: str,
    transport: str | None,
    render: tuple[str, ...],
    engine: tuple[str, ...],
) -> tuple[TierPlan, ...]:
    """The render, prefill, decode and encoder tiers: their commands, the model (None: each
    replica resolves the demo model itself), and the shared flags of each kind."""
    given_model = (model,) if model else ()
    name = ("--served-model-name", served_model_name) if served_model_name else ()
    tiers = [
        TierPlan(
            "render",
            ("render", *given_model, "--log-level", log_level, *name, *render),
            (INTERNAL_TOKEN_ENV, STATE_KEY_ENV),  # one state key: any replica continues any stream
        )
    ]
    kv = ("--kv-mode", mode, *(("--kv-transport", transport) if transport else ()))
    for role in SERVER_TIERS[1:]:
        argv = ("engine", *given_model, "--role", role, "--log-level", log_level)
        argv += kv if role in KV_ROLES else ()
        tiers.append(TierPlan(role, (*argv, *engine), (INTERNAL_TOKEN_ENV,)))
    return tuple(tiers)


def plan_from_args(
    args: argparse.Namespace, model: str | None, served_model_name: str | None
) -> DeploymentPlan:
    """`up`'s plan: the server tiers from its flags (`model` as the launcher resolved it),
    then the proxy."""
    tiers = server_tiers(
        model=model,
        served_model_name=served_model_name,
        log_level=args.log_level,
        mode=args.mode,
        transport=args.transport,
        render=render_flags(args),
        engine=engine_flags(args),
    )
    proxy = TierPlan("proxy", ("proxy", *proxy_flags(args)), (INTERNAL_TOKEN_ENV, API_KEY_ENV))
    if getattr(args, "afd", None):
        tiers = (*tiers, ffn_tier(model, args.log_level, engine_flags(args)))
    if getattr(args, "kv_store", False):
        tiers = (*tiers, store_tier(args.log_level, store_flags(args)))
    return DeploymentPlan(tiers=(*tiers, proxy), replicas=up_replicas(args))


def ffn_tier(model: str | None, log_level: str, engine: tuple[str, ...]) -> TierPlan:
    """`up --afd`'s FFN daemons: the engine's flags (the dtype must be the attention
    engines'), the host and port the launcher's."""
    given_model = (model,) if model else ()
    argv = ("engine", *given_model, "--role", FFN_ROLE, "--log-level", log_level, *engine)
    return TierPlan(FFN_ROLE, argv, (INTERNAL_TOKEN_ENV,))


def deployment_secrets(api_key: str | None) -> dict[str, str]:
    """The values behind the plan's secret names: one internal token per deployment (or the
    one this shell has), the render replicas' shared state key (the same), and the API key
    the proxy checks (when there is one)."""
    values = {
        INTERNAL_TOKEN_ENV: os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32),
        STATE_KEY_ENV: os.environ.get(STATE_KEY_ENV) or secrets.token_hex(32),
    }
    if api_key:
        values[API_KEY_ENV] = api_key
    return values


def tier_env(tier: TierPlan, values: dict[str, str]) -> dict[str, str]:
    """The secrets of `values` that `tier`'s processes get."""
    return {name: values[name] for name in tier.secret_names if name in values}


def kv_event_flags(host: str, events_port: int, replay_port: int) -> list[str]:
    """Where a KV engine (or the KV store) publishes its KV events (the proxy's router
    indexes them for cache-aware routing), on the address its replica has."""
    return [
        "--kv-events-endpoint", f"tcp://{host}:{events_port}",
        "--kv-events-replay-endpoint", f"tcp://{host}:{replay_port}",
    ]  # fmt: skip
