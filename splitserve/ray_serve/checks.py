"""Checking a Ray deployment's config before anything is deployed: what can be told
without a cluster (`check`), then against the nodes the cluster has (`check_cluster`)."""

from __future__ import annotations

import os

from splitserve.deploy.plan import FFN_ROLE, STORE_ROLE
from splitserve.ray_serve.config import PLANNED_TIERS, STORE_KEYS, TIERS, ConfigError, RayDeployConfig

HIDDEN_RESOURCES = ("memory", "object_store_memory")  # not asked for by any tier: left out of messages


def check(config: RayDeployConfig) -> None:
    """What can be told without a cluster; ConfigError says what is wrong."""
    names = [name for name, _ in config.tiers]
    for name in names:
        if name not in TIERS:
            raise ConfigError(f"unknown tier {name!r} (tiers: {', '.join(TIERS)})")
    if len(set(names)) != len(names):
        raise ConfigError("a tier is named twice")
    for name, spec in config.tiers:
        if spec.autoscaling:
            low = spec.min_replicas if spec.min_replicas is not None else spec.replicas
            if spec.max_replicas is not None and not low <= spec.replicas <= spec.max_replicas:
                raise ConfigError(
                    f"{name}: replicas {spec.replicas} must lie within min_replicas {low} "
                    f"and max_replicas {spec.max_replicas}"
                )
        elif spec.min_replicas is not None:
            raise ConfigError(f"{name}: min_replicas needs max_replicas (autoscaling bounds)")
    if config.tier(FFN_ROLE).autoscaling:
        raise ConfigError(
            "ffn: the FFN daemons do not autoscale (no load signal): set replicas, not max_replicas"
        )
    if config.runs(FFN_ROLE) and config.runs("encoder"):
        raise ConfigError(
            "ffn: attention-FFN disaggregation serves text MoE models, not with an encoder tier"
        )
    for name in ("render", "decode"):
        if config.tier(name).lowest_replicas < 1:
            raise ConfigError(f"{name}: needs at least 1 replica (got {config.tier(name).lowest_replicas})")
    if config.mode not in ("push", "pull"):
        raise ConfigError(f"mode: push or pull, not {config.mode!r}")
    if config.pd_decision not in ("cost", "threshold"):
        raise ConfigError(f"pd_decision: cost or threshold, not {config.pd_decision!r}")
    if config.transport not in (None, "shm", "tcp", "auto"):
        raise ConfigError(f"transport: shm, tcp, auto or unset (auto), not {config.transport!r}")
    if config.proxy_location not in ("HeadOnly", "EveryNode"):
        raise ConfigError(f"proxy_location: HeadOnly or EveryNode, not {config.proxy_location!r}")
    check_store(config)
    if config.planner is not None:
        if not config.tier("decode").autoscaling:
            raise ConfigError("planner: the decode tier needs autoscaling bounds (max_replicas)")
        for name in PLANNED_TIERS:
            spec = config.tier(name)
            if spec.autoscaling and spec.lowest_replicas < 1:
                # Serve asks a tier's own replicas for its target: a tier at zero has none
                raise ConfigError(f"planner: {name} needs min_replicas >= 1 to be planned")
        if not 0 < config.planner.target <= 1:
            raise ConfigError(f"planner.target must be in (0, 1], got {config.planner.target:g}")


def check_store(config: RayDeployConfig) -> None:
    """The KV store tier: one replica at most (one store: the engines all offload to it
    and the router follows its events), sizes it can take, a disk path for its node."""
    store = config.tier(STORE_ROLE)
    if store.autoscaling or store.replicas > 1:
        raise ConfigError(f"{STORE_ROLE}: one replica (the deployment has one KV store), not autoscaled")
    if not config.runs(STORE_ROLE):
        defaults = RayDeployConfig(model=None, tiers=())
        if any(getattr(config, key) != getattr(defaults, key) for key in STORE_KEYS):
            raise ConfigError(f"{', '.join(STORE_KEYS)}: need the KV store (--kv-store; tiers.{STORE_ROLE})")
        return
    disk = config.kv_store_disk
    if disk is not None and not (isinstance(disk, str) and os.path.isabs(disk)):
        raise ConfigError(f"kv_store_disk: an absolute path on the store's node, not {disk!r}")
    try:
        config.store_flags()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def shown_resource(name: str) -> bool:
    """Resources a message lists: not memory, nor Ray's per-node labels (node:IP, ...)."""
    return name not in HIDDEN_RESOURCES and ":" not in name


def check_cluster(config: RayDeployConfig, nodes: list[dict[str, float]]) -> None:
    """Every tier that runs a replica fits on at least one node (`nodes`: each alive node's
    total resources, as `ray.nodes()` reports them)."""
    for name, spec in config.tiers:
        if not config.runs(name):
            continue
        demand = spec.demand()
        if not any(all(node.get(k, 0.0) >= v for k, v in demand.items()) for node in nodes):
            offered = "; ".join(
                ", ".join(f"{k}={v:g}" for k, v in sorted(n.items()) if shown_resource(k)) for n in nodes
            )
            wanted = ", ".join(f"{k}={v:g}" for k, v in sorted(demand.items()))
            raise ConfigError(
                f"{name}: no node in the cluster has {wanted} for one replica (nodes: {offered or 'none'})"
            )
