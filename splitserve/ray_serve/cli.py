"""`splitserve up --ray [ADDRESS]` and `splitserve down --ray [ADDRESS]`."""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.deploy.plan import STORE_ROLE
from splitserve.ray_serve.checks import check, check_cluster
from splitserve.ray_serve.config import ConfigError, RayDeployConfig, config_from_args
from splitserve.runtime.access import API_KEY_ENV

DEFAULT_APP_NAME = "splitserve"
RAY_CLIENT_PORT = 10001  # Ray Client's default port on the head node (`ray start --head`)


def ray_address(text: str) -> str:
    """`--ray`'s ADDRESS, checked before connecting: `auto` (the cluster this host belongs
    to), `HOST:PORT` (its GCS), or `ray://HOST[:PORT]` (Ray Client, port 10001 when left
    out); argparse turns the ValueError into a usage error (exit 2)."""
    if text == "auto":
        return text
    client = text.startswith("ray://")
    rest = text.removeprefix("ray://") if client else text
    if "://" in rest or "/" in rest:
        raise ValueError(f"{text!r}: expected auto, HOST:PORT or ray://HOST[:PORT]")
    bare = ":" not in rest or rest.endswith("]")  # no port (an IPv6 host is in brackets)
    host, colon, port = (rest, "", "") if bare else rest.rpartition(":")
    if not host or (colon and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(f"{text!r}: expected auto, HOST:PORT or ray://HOST[:PORT]")
    if client:
        return f"ray://{host}:{port or RAY_CLIENT_PORT}"
    if not colon:
        raise ValueError(f"{text!r}: a GCS address needs its port (HOST:PORT, usually 6379)")
    return text


def address_argument(text: str) -> str:
    try:
        return ray_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """`up`'s Ray flags (docs/ray.md)."""
    group = parser.add_argument_group("Ray Serve (splitserve[ray]; docs/ray.md)")
    group.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        type=address_argument,
        metavar="ADDRESS",
        help="deploy on a running Ray cluster instead (auto, HOST:PORT or ray://HOST:10001) and exit",
    )
    group.add_argument("--ray-config", default=None, metavar="YAML", help="the deployment from a file")
    group.add_argument(
        "--ray-tier",
        action="append",
        default=[],
        metavar="TIER:KEY=N,...",
        help="per tier: num_cpus, num_gpus, min_replicas, max_replicas, target; any other key "
        "is a custom resource (e.g. decode:num_gpus=1,gpu_node=1,max_replicas=4)",
    )
    group.add_argument("--ray-app-name", default=DEFAULT_APP_NAME, help="the Serve application's name")
    group.add_argument(
        "--ray-planner",
        action="store_true",
        help="size the prefill and decode tiers from the traffic the proxy sees, within their "
        "--ray-tier bounds, with --slo-*, --target and --profile as for --plan (docs/ray.md)",
    )
    group.add_argument(
        "--ray-planner-interval",
        type=float,
        default=30.0,
        metavar="S",
        help="--ray-planner: seconds of traffic each decision reads (default 30)",
    )


def connect(address: str, command: str) -> bool:
    """Join the cluster at `address` as a driver; False (and why, on stderr) when it fails."""
    import ray

    try:
        ray.init(address=address, logging_level="warning", log_to_driver=False)
    except Exception as exc:  # ray raises ConnectionError, RuntimeError, TimeoutError, ...
        print(f"splitserve {command}: cannot join the Ray cluster at {address}: {exc}", file=sys.stderr)
        return False
    return True


def run_up(args: argparse.Namespace) -> int:
    """Check the config (alone, then against the cluster's nodes), deploy, wait until every
    replica has registered with the router, print the endpoints."""
    try:
        config = config_from_args(args)
        check(config)
        if config.planner is not None and config.planner.profile:
            from splitserve.sim.profile import load_profile

            load_profile(config.planner.profile)  # a bad file is told here, not in the ingress's log
    except (ConfigError, ValueError) as exc:
        print(f"splitserve up --ray: {exc}", file=sys.stderr)
        return 2
    try:
        import ray  # noqa: F401
    except ImportError:
        print("splitserve up --ray: needs ray: pip install 'splitserve[ray]'", file=sys.stderr)
        return 2
    if not connect(args.ray, "up --ray"):
        return 1
    from splitserve.ray_serve.app import cluster_nodes, deploy, deployment_errors, remove, wait_registered
    from splitserve.ray_serve.config import with_transport

    nodes = cluster_nodes()
    try:
        check_cluster(config, nodes)
    except ConfigError as exc:
        print(f"splitserve up --ray: {exc}; nothing deployed", file=sys.stderr)
        return 2
    config = with_transport(config)
    try:
        endpoint = deploy(config, args.api_key or os.environ.get(API_KEY_ENV) or None)
        members = wait_registered(config, args.startup_timeout)
    except (RuntimeError, TimeoutError) as exc:  # Serve's error carries the replica's (its server's log)
        for reason in [str(exc), *deployment_errors(config.app_name)]:
            print(f"splitserve up --ray: {reason}", file=sys.stderr)
        print("splitserve up --ray: removing the application", file=sys.stderr)
        remove(config.app_name)
        return 1
    print_endpoints(config, len(nodes), endpoint, members)
    return 0


def print_endpoints(config: RayDeployConfig, num_nodes: int, endpoint: str, members: list[dict]) -> None:
    counts = ", ".join(f"{spec.replicas} {name}" for name, spec in config.tiers if spec.replicas)
    transport = config.transport
    if transport == "auto":
        transport = "auto (shm within a node, tcp across nodes)"
    where = f"app {config.app_name!r} on {num_nodes} node(s)"
    print(f"splitserve up --ray: {where}: {counts}; KV over {transport}")
    for member in sorted(members, key=lambda m: (m["role"], m["url"])):
        ec = f", encoder cache over {member['encoder_cache']}" if member.get("encoder_cache") else ""
        blocks = f", blocks at {member['kv_store']}" if member["role"] == STORE_ROLE else ""
        print(f"  {member['role']:<8} {member['url']}  (node {member['node_id'][:12]}{ec}{blocks})")
    if not endpoint.endswith(f":{config.http_port}"):
        print(f"  (Serve already ran on this cluster: its HTTP proxy keeps {endpoint})")
    print(f"OpenAI API: {endpoint}/v1  (`splitserve down --ray` removes it)", flush=True)


def add_down_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray", nargs="?", const="auto", default=None, type=address_argument, metavar="ADDRESS",
        help="the Ray cluster the deployment runs on (auto, HOST:PORT or ray://HOST:10001)",
    )  # fmt: skip
    parser.add_argument("--ray-app-name", default=DEFAULT_APP_NAME, help="the Serve application's name")


def run_down(args: argparse.Namespace) -> int:
    if args.ray is None:
        print(
            "splitserve down: only a Ray deployment runs in the background (--ray); "
            "`splitserve up` stops with Ctrl-C",
            file=sys.stderr,
        )
        return 2
    if not connect(args.ray, "down --ray"):
        return 1
    from splitserve.ray_serve.app import remove

    if not remove(args.ray_app_name):
        print(f"splitserve down --ray: no application {args.ray_app_name!r}", file=sys.stderr)
        return 1
    print(f"splitserve down --ray: removed {args.ray_app_name!r}")
    return 0
