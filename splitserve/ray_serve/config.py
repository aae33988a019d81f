"""The Ray deployment's config: one frozen value, from a YAML file or from `splitserve up`'s
flags, checked before anything is deployed (`check`, then `check_cluster` against the
nodes the cluster has)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from splitserve.deploy.plan import (
    FFN_ROLE,
    STORE_ROLE,
    TierPlan,
    engine_flags,
    ffn_tier,
    render_flags,
    server_tiers,
    store_size_flags,
    store_tier,
)
from splitserve.goodput import SLO, SLO_AVERAGE, SLO_WORST_GAP

TIERS = ("render", "prefill", "decode", "encoder", FFN_ROLE, STORE_ROLE)  # ffn: `--afd`'s FFN daemons
# The tier each replica's load signal comes from (autoscaling.py, docs/ray.md).
DEFAULT_TARGETS = {"render": 0.7, "prefill": 2.0, "decode": 0.7, "encoder": 2.0}
TIER_KEYS = (
    "replicas", "num_cpus", "num_gpus", "resources",
    "min_replicas", "max_replicas", "target", "upscale_delay_s", "downscale_delay_s", "metrics_interval_s",
)  # fmt: skip
TOP_KEYS = (
    "model", "served_model_name", "app_name", "http_host", "http_port", "transport", "mode",
    "min_prefill_tokens", "pd_decision", "log_level", "engine_args", "render_args", "proxy_location",
    "tiers", "open_health_metrics", "planner", "kv_store_ram_gb", "kv_store_disk", "kv_store_disk_gb",
)  # fmt: skip
STORE_KEYS = ("kv_store_ram_gb", "kv_store_disk", "kv_store_disk_gb")  # the KV store tier's sizes
PLANNER_KEYS = ("interval_s", "slo_ttft", "slo_tpot", "slo_gap", "target", "profile")


class ConfigError(ValueError):
    """A config that cannot be deployed; the message says what to change."""


@dataclass(frozen=True)
class PlannerSettings:
    """`--ray-planner` (the YAML config's `planner:` mapping): re-plan the prefill and
    decode tiers' replica targets from the traffic every `interval_s` (planner_loop.py)."""

    interval_s: float = 30.0
    slos: tuple[SLO, ...] = (SLO_AVERAGE, SLO_WORST_GAP)
    target: float = 0.9  # the fraction of requests that must meet the SLOs
    profile: str | None = None  # one replica's `sim calibrate --out FILE`, a path the head node has
    max_num_batched_tokens: int = 2048  # the engines' token budget per step
    long_prefill_token_threshold: int = 0  # the engines' (`up --ray`'s flags: up's, 32)


PLANNED_TIERS = ("prefill", "decode")  # the tiers `--ray-planner` sizes


class PlannerInputs(NamedTuple):
    """What the ingress's planner loop is built from (app.py hands it over)."""

    settings: PlannerSettings
    model: str | None  # as the tiers get it: None, the demo model
    bounds: dict[str, tuple[int, int]]  # per planned tier: (lowest, highest) replicas
    initial: dict[str, int]  # per planned tier: the replicas it is deployed with
    num_cpus: float  # one engine replica's
    mode: str  # push or pull


@dataclass(frozen=True)
class TierSpec:
    """One tier's replicas and what each replica asks of its node. `max_replicas` set:
    Serve autoscales the tier between `min_replicas` and `max_replicas` on the tier's own
    load signal, aiming at `target` per replica (autoscaling.py)."""

    replicas: int
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources, for placement
    min_replicas: int | None = None
    max_replicas: int | None = None
    target: float | None = None
    upscale_delay_s: float = 10.0  # how long the signal must ask for more before Serve adds one
    downscale_delay_s: float = 60.0
    metrics_interval_s: float | None = None  # how often replicas report the signal (None: Serve's 10 s)

    def demand(self) -> dict[str, float]:
        """What one replica needs from one node, in Ray's resource names."""
        needs = {"CPU": self.num_cpus, "GPU": self.num_gpus, **dict(self.resources)}
        return {name: amount for name, amount in needs.items() if amount > 0}

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def lowest_replicas(self) -> int:
        return self.min_replicas if self.autoscaling and self.min_replicas is not None else self.replicas


@dataclass(frozen=True)
class ServerConfig:
    """What a tier replica needs to start its server: the part of the config that, when
    it changes, restarts replicas (the replica counts are not in it, so scaling a tier
    leaves the others running)."""

    app_name: str
    tiers: tuple[TierPlan, ...]  # each server tier's command line (deploy/plan.py)
    transport: str | None  # "auto": an engine is told its node too
    encoder_cache: bool = False  # an encoder tier runs: engines load embeddings from its cache
    afd: bool = False  # an ffn tier runs: the decode engines are its attention engines
    kv_store: bool = False  # a KV store tier runs: engines offload to it and load from it

    def tier(self, role: str) -> TierPlan:
        return next(tier for tier in self.tiers if tier.role == role)


@dataclass(frozen=True)
class RayDeployConfig:
    model: str | None  # a path every node has, or an HF ID each node resolves (None: the demo model)
    tiers: tuple[tuple[str, TierSpec], ...]
    served_model_name: str | None = None
    app_name: str = "splitserve"
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    transport: str | None = None  # None: auto (shm between engines on one node, tcp across nodes)
    mode: str = "push"
    min_prefill_tokens: int = 64
    pd_decision: str = "cost"  # or "threshold" (min_prefill_tokens): the proxy's --pd-decision
    log_level: str = "warning"
    engine_args: tuple[str, ...] = ()  # more `splitserve engine` flags for every engine
    render_args: tuple[str, ...] = ()  # more `splitserve render` flags
    proxy_location: str = "HeadOnly"  # Serve's HTTP proxy: HeadOnly or EveryNode
    open_health_metrics: bool = False  # the ingress's /health and /metrics answer without the API key
    planner: PlannerSettings | None = None  # None: each tier autoscales on its own load signal
    # the KV store tier's sizes (`tiers.kvstore` runs it); the disk, a directory its node has
    kv_store_ram_gb: float = 4.0
    kv_store_disk: str | None = None
    kv_store_disk_gb: float | None = None

    def tier(self, name: str) -> TierSpec:
        return dict(self.tiers).get(name, TierSpec(replicas=0))

    def server(self) -> ServerConfig:
        """The tiers' plan (the same command lines `up` starts locally) and what a replica
        needs besides."""
        tiers = server_tiers(
            model=self.model,
            served_model_name=self.served_model_name,
            log_level=self.log_level,
            mode=self.mode,
            transport=self.transport,
            render=self.render_args,
            engine=self.engine_args,
        )
        afd = self.runs(FFN_ROLE)
        if afd:
            tiers = (*tiers, ffn_tier(self.model, self.log_level, self.engine_args))
        if self.runs(STORE_ROLE):
            tiers = (*tiers, store_tier(self.log_level, self.store_flags()))
        return ServerConfig(
            app_name=self.app_name,
            tiers=tiers,
            transport=self.transport,
            encoder_cache=self.runs("encoder"),
            afd=afd,
            kv_store=self.runs(STORE_ROLE),
        )

    def store_flags(self) -> tuple[str, ...]:
        """The KV store's size flags; ValueError for sizes it cannot take."""
        return store_size_flags(self.kv_store_ram_gb, self.kv_store_disk, self.kv_store_disk_gb)

    def runs(self, name: str) -> bool:
        """Whether the tier has a replica now or may get one (autoscaling)."""
        spec = self.tier(name)
        return spec.replicas > 0 or bool(spec.max_replicas)


def _number(where: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum:g}, got {value!r}")
    return float(value)


def _count(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def tier_from_mapping(name: str, raw: Mapping[str, Any]) -> TierSpec:
    if name not in TIERS:
        raise ConfigError(f"unknown tier {name!r} (tiers: {', '.join(TIERS)})")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"tiers.{name}: expected a mapping, got {raw!r}")
    unknown = sorted(set(raw) - set(TIER_KEYS))
    if unknown:
        raise ConfigError(f"tiers.{name}: unknown key(s) {', '.join(unknown)} (keys: {', '.join(TIER_KEYS)})")
    resources = raw.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise ConfigError(f"tiers.{name}.resources: expected a mapping of resource name to amount")
    optional = {key: raw.get(key) for key in ("min_replicas", "max_replicas")}
    return TierSpec(
        replicas=_count(f"tiers.{name}.replicas", raw.get("replicas", 1)),
        num_cpus=_number(f"tiers.{name}.num_cpus", raw.get("num_cpus", 1.0)),
        num_gpus=_number(f"tiers.{name}.num_gpus", raw.get("num_gpus", 0.0)),
        resources=tuple(
            sorted((str(k), _number(f"tiers.{name}.resources.{k}", v)) for k, v in resources.items())
        ),
        min_replicas=None if optional["min_replicas"] is None else _count(
            f"tiers.{name}.min_replicas", optional["min_replicas"]
        ),
        max_replicas=None if optional["max_replicas"] is None else _count(
            f"tiers.{name}.max_replicas", optional["max_replicas"]
        ),
        target=None if raw.get("target") is None else _number(f"tiers.{name}.target", raw["target"], 1e-9),
        upscale_delay_s=_number(f"tiers.{name}.upscale_delay_s", raw.get("upscale_delay_s", 10.0)),
        downscale_delay_s=_number(f"tiers.{name}.downscale_delay_s", raw.get("downscale_delay_s", 60.0)),
        metrics_interval_s=None if raw.get("metrics_interval_s") is None else _number(
            f"tiers.{name}.metrics_interval_s", raw["metrics_interval_s"], 0.1
        ),
    )  # fmt: skip


def config_from_mapping(raw: Mapping[str, Any]) -> RayDeployConfig:
    """A config from parsed YAML (or any mapping); ConfigError names the bad key."""
    if not isinstance(raw, Mapping):
        raise ConfigError("the config must be a mapping (YAML keys: " + ", ".join(TOP_KEYS) + ")")
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} (keys: {', '.join(TOP_KEYS)})")
    tiers = raw.get("tiers") or {}
    if not isinstance(tiers, Mapping):
        raise ConfigError("tiers: expected a mapping of tier name to its settings")
    fields: dict[str, Any] = {k: v for k, v in raw.items() if k != "tiers"}
    for key in ("engine_args", "render_args"):
        if key in fields:
            if not isinstance(fields[key], list) or not all(isinstance(a, str) for a in fields[key]):
                raise ConfigError(f"{key}: expected a list of strings (command-line flags)")
            fields[key] = tuple(fields[key])
    if "model" not in fields:
        fields["model"] = None
    if fields.get("planner") is not None:
        # the engines run with what engine_args give them, else the engine's default (no cap)
        flag = "--long-prefill-token-threshold"
        given = engine_arg(fields.get("engine_args", ()), flag)
        threshold = (
            0 if given is None else _count(f"engine_args: {flag}", int(given) if given.isdigit() else given)
        )
        fields["planner"] = dataclasses.replace(
            planner_from_mapping(fields["planner"]), long_prefill_token_threshold=threshold
        )
    for key in ("kv_store_ram_gb", "kv_store_disk_gb"):
        if fields.get(key) is not None:
            fields[key] = _number(key, fields[key])
    return RayDeployConfig(
        tiers=tuple((str(name), tier_from_mapping(str(name), spec)) for name, spec in tiers.items()), **fields
    )


def engine_arg(args: Sequence[str], flag: str) -> str | None:
    """The value `args` give `flag` (`--flag V` or `--flag=V`), the last one; None if absent."""
    found = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    return found


def planner_from_mapping(raw: Any) -> PlannerSettings:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"planner: expected a mapping (keys: {', '.join(PLANNER_KEYS)})")
    unknown = sorted(set(raw) - set(PLANNER_KEYS))
    if unknown:
        raise ConfigError(f"planner: unknown key(s) {', '.join(unknown)} (keys: {', '.join(PLANNER_KEYS)})")
    slo_keys = ("slo_ttft", "slo_tpot", "slo_gap")
    bounds = {k: _number(f"planner.{k}", raw[k], 1e-6) for k in slo_keys if k in raw}
    slos = (
        (SLO(ttft=bounds.get("slo_ttft"), tpot=bounds.get("slo_tpot"), gap=bounds.get("slo_gap")),)
        if bounds
        else PlannerSettings.slos
    )
    profile = raw.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise ConfigError(f"planner.profile: expected a path, got {profile!r}")
    return PlannerSettings(
        interval_s=_number("planner.interval_s", raw.get("interval_s", PlannerSettings.interval_s), 1.0),
        slos=slos,
        target=_number("planner.target", raw.get("target", PlannerSettings.target), 1e-6),
        profile=profile,
    )


def load_yaml(path: str) -> RayDeployConfig:
    import yaml

    try:
        with open(path, encoding="utf-8") as config_file:
            raw = yaml.safe_load(config_file)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return config_from_mapping(raw or {})


def parse_tier_flag(text: str) -> tuple[str, dict[str, Any]]:
    """`decode:num_gpus=1,max_replicas=4,gpu_node=1` → ("decode", {...}); keys other than
    the tier keys are custom resources."""
    name, _, settings = text.partition(":")
    raw: dict[str, Any] = {}
    resources: dict[str, float] = {}
    for item in filter(None, settings.split(",")):
        key, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"--ray-tier {text}: {item!r} is not KEY=NUMBER") from None
        if not sep:
            raise ConfigError(f"--ray-tier {text}: {item!r} is not KEY=NUMBER")
        if key in ("replicas", "min_replicas", "max_replicas"):
            raw[key] = int(number) if number.is_integer() else number
        elif key in TIER_KEYS:
            raw[key] = number
        else:
            resources[key] = number
    if resources:
        raw["resources"] = resources
    return name, raw


def config_from_args(args: argparse.Namespace) -> RayDeployConfig:
    """The config `splitserve up --ray` deploys: `--ray-config FILE`, or the same flags as
    `up` (`--prefill/--decode/--render/--encoder`, model, the render's and the engines'
    flags as `up`'s plan has them) with `--ray-tier` settings per tier."""
    if args.ray_config:
        return load_yaml(args.ray_config)
    tiers: dict[str, dict[str, Any]] = {
        "render": {"replicas": args.render},
        "prefill": {"replicas": args.prefill},
        "decode": {"replicas": args.decode},
        "encoder": {"replicas": args.encoder},
        "ffn": {"replicas": args.afd[1] if getattr(args, "afd", None) else 0},
    }
    if args.kv_store:
        tiers[STORE_ROLE] = {"replicas": 1}
    for text in args.ray_tier or ():
        name, settings = parse_tier_flag(text)
        if name not in TIERS:
            raise ConfigError(f"--ray-tier {text}: unknown tier {name!r} (tiers: {', '.join(TIERS)})")
        if name not in tiers:
            raise ConfigError(f"--ray-tier {text}: the {name} tier runs with --kv-store only")
        tiers[name].update(settings)
    return RayDeployConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        tiers=tuple((name, tier_from_mapping(name, spec)) for name, spec in tiers.items()),
        app_name=args.ray_app_name,
        http_host=args.host,
        http_port=args.port,
        transport=args.transport,
        mode=args.mode,
        min_prefill_tokens=args.min_prefill_tokens,
        pd_decision=args.pd_decision,
        open_health_metrics=args.open_health_metrics,
        log_level=args.log_level,
        engine_args=engine_flags(args),
        render_args=render_flags(args),
        planner=planner_from_args(args),
        kv_store_ram_gb=args.kv_store_ram_gb,
        kv_store_disk=args.kv_store_disk and os.path.abspath(args.kv_store_disk),
        kv_store_disk_gb=args.kv_store_disk_gb,
    )


def planner_from_args(args: argparse.Namespace) -> PlannerSettings | None:
    """`--ray-planner` with `up --plan`'s SLO, target and profile flags (None without it)."""
    if not args.ray_planner:
        return None
    raw: dict[str, Any] = {"interval_s": args.ray_planner_interval, "target": args.target}
    for key in ("slo_ttft", "slo_tpot", "slo_gap", "profile"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    settings = planner_from_mapping(raw)
    if args.max_num_batched_tokens:
        settings = dataclasses.replace(settings, max_num_batched_tokens=args.max_num_batched_tokens)
    return dataclasses.replace(settings, long_prefill_token_threshold=args.long_prefill_token_threshold)


def with_transport(config: RayDeployConfig) -> RayDeployConfig:
    """KV transport chosen per pair when the config leaves it open: `auto`, each engine
    told its Ray node, so two engines on one node move KV through shared memory and two on
    different nodes over tcp (a replica replaced lands wherever it fits); on a GPU, tcp."""
    if config.transport is not None:
        return config
    return dataclasses.replace(config, transport="auto")
