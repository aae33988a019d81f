"""Building, deploying and removing the Ray Serve application (`splitserve up --ray`,
`splitserve down --ray`)."""

from __future__ import annotations

import os
import time
from typing import Any

from splitserve.deploy.plan import FFN_ROLE, deployment_secrets
from splitserve.ray_serve.config import (
    DEFAULT_TARGETS,
    PLANNED_TIERS,
    PlannerInputs,
    RayDeployConfig,
    TierSpec,
)
from splitserve.ray_serve.ingress import ProxyIngress
from splitserve.ray_serve.tier import INGRESS_NAME, TierReplica
from splitserve.runtime.access import API_KEY_ENV

HEALTH_CHECK_PERIOD_S = 2.0  # also the tier replicas' heartbeat to the ingress
GRACEFUL_SHUTDOWN_S = 30.0  # a replica torn down drains its server first
# How often a replica being torn down checks for requests still running (Serve's default,
# 2 s, is added to every scale-down and `down` of an idle replica).
SHUTDOWN_POLL_S = 0.25


def deployment_options(
    name: str, spec: TierSpec, env: dict[str, str], planned: bool = False
) -> dict[str, Any]:
    """Serve options of one tier's deployment: placement, replicas or autoscaling bounds
    (`planned`: the replica target is the planner's, within them)."""
    actor: dict[str, Any] = {
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "runtime_env": {"env_vars": env},
    }
    if spec.resources:
        actor["resources"] = dict(spec.resources)
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": actor,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        "max_ongoing_requests": 64,  # handle calls only: traffic reaches the servers directly
    }
    if spec.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": spec.lowest_replicas,
            "initial_replicas": spec.replicas,
            "max_replicas": spec.max_replicas,
            "upscale_delay_s": spec.upscale_delay_s,
            "downscale_delay_s": spec.downscale_delay_s,
            "policy": {
                "policy_function": "splitserve.ray_serve.autoscaling:TierLoadPolicy",
                "policy_kwargs": {"target": spec.target or DEFAULT_TARGETS[name], "planned": planned},
            },
        }
        if spec.metrics_interval_s is not None:  # how often each replica reports its signal
            options["autoscaling_config"]["metrics_interval_s"] = spec.metrics_interval_s
    else:
        options["num_replicas"] = spec.replicas
    return options


def build_app(config: RayDeployConfig, env: dict[str, str]):
    """The bound Serve application: the ingress, with one deployment per tier bound to it
    (so they are part of the app; they reach the ingress by name, not the other way)."""
    from ray import serve

    tiers = {}
    server = config.server()
    # the ffn tier first: its handle is bound into the decode tier (attention engines)
    for name, spec in sorted(config.tiers, key=lambda tier: tier[0] != FFN_ROLE):
        if spec.replicas == 0 and not spec.autoscaling:
            continue
        planned = config.planner is not None and name in PLANNED_TIERS and spec.autoscaling
        deployment = serve.deployment(TierReplica).options(**deployment_options(name, spec, env, planned))
        ffn = tiers.get(FFN_ROLE) if name == "decode" else None
        tiers[name] = deployment.bind(name, server, ffn) if ffn is not None else deployment.bind(name, server)
    ingress = serve.deployment(serve.ingress()(ProxyIngress)).options(
        name=INGRESS_NAME,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        max_ongoing_requests=4096,  # the proxy's own limits apply behind it
    )
    return ingress.bind(
        config.min_prefill_tokens,
        config.mode,
        config.open_health_metrics,
        config.runs("encoder"),
        config.pd_decision,
        planner_inputs(config),
        **tiers,
    )


def planner_inputs(config: RayDeployConfig) -> PlannerInputs | None:
    """What the ingress's planner loop needs: the settings, the model, each planned tier's
    bounds and one engine replica's CPUs (None: no `--ray-planner`)."""
    if config.planner is None:
        return None
    bounds = {}
    for name in PLANNED_TIERS:
        spec = config.tier(name)
        high = spec.max_replicas if spec.autoscaling and spec.max_replicas is not None else spec.replicas
        bounds[name] = (spec.lowest_replicas, high)
    initial = {name: config.tier(name).replicas for name in PLANNED_TIERS}
    return PlannerInputs(
        config.planner, config.model, bounds, initial, config.tier("decode").num_cpus, config.mode
    )


def cluster_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def deploy(config: RayDeployConfig, api_key: str | None) -> str:
    """Deploy on the cluster `ray.init` connected to; the OpenAI endpoint. Serve's HTTP
    proxy keeps the host and port it was first started with on this cluster (`remove`
    stops Serve with the last application, so the next deploy sets them again)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(
        http_options={"host": config.http_host, "port": config.http_port, "location": config.proxy_location}
    )
    serve.run(build_app(config, deployment_secrets(api_key)), name=config.app_name, route_prefix="/")
    http = _get_global_client().http_config  # what Serve runs with, not what was asked
    host = http.host if http.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host}:{http.port}"


def workers(app_name: str) -> list[dict]:
    from ray import serve

    return serve.get_deployment_handle(INGRESS_NAME, app_name=app_name).workers.remote().result()


def wait_registered(config: RayDeployConfig, timeout_s: float) -> list[dict]:
    """The registered workers once every tier has its replicas in the router; TimeoutError.
    (FFN daemons do not register: the decode replicas, healthy only once their daemon
    answered HELLO, stand for them.)"""
    wanted = {name: spec.replicas for name, spec in config.tiers if spec.replicas and name != FFN_ROLE}
    deadline = time.monotonic() + timeout_s
    while True:
        members = workers(config.app_name)
        counts = {name: sum(1 for m in members if m["role"] == name and m["healthy"]) for name in wanted}
        if all(counts[name] >= wanted[name] for name in wanted):
            return members
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every replica registered after {timeout_s:.0f}s: {counts} of {wanted}")
        time.sleep(0.1)


def deployment_errors(app_name: str) -> list[str]:
    """Why the application's deployments failed: each failing one's last error (for a tier,
    its server's exit code and the end of its log)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    errors = []
    for name, deployment in (app.deployments if app else {}).items():
        if deployment.message and "Error" in deployment.message:
            first_line, _, rest = deployment.message.rpartition("Error: ")[2].strip().partition("\n")
            errors.append(f"{name}: {first_line}\n{rest[-1200:]}")  # the log's end says why
    return errors


def remove(app_name: str) -> bool:
    """Delete the application (replicas drain and leave), and Serve once no application
    is left; whether it was there."""
    from ray import serve

    if app_name not in serve.status().applications:
        return False
    serve.delete(app_name)
    if not serve.status().applications:  # Serve with no application left: stop it too
        serve.shutdown()
    return True


def app_builder(args: dict[str, Any]):
    """Serve's application builder for a declarative deployment (`serve deploy`, KubeRay's
    RayService: `import_path: splitserve.ray_serve.app:app_builder`, `args:` the YAML
    config's keys). Checked like `up --ray`; the secrets come from the environment of the
    process that builds the app (a Kubernetes Secret), a fresh token when none is set.
    Not checked against the cluster's nodes: there, the autoscaler adds the nodes a tier
    asks for (and the worker pods may still be starting)."""
    from splitserve.ray_serve.checks import check
    from splitserve.ray_serve.config import config_from_mapping, with_transport

    config = config_from_mapping(args)
    check(config)
    return build_app(with_transport(config), deployment_secrets(os.environ.get(API_KEY_ENV) or None))
