"""The Ray deployment tests' cluster (two local nodes) and the deployment's secrets: one
per test module that asks for them."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum object store, per node


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    import ray
    from ray.cluster_utils import Cluster

    node = {"object_store_memory": STORE_BYTES, "include_dashboard": False}
    with pytest.MonkeyPatch.context() as patch:
        # Replicas report their load every second (default 10 s), so the scale-up comes soon.
        # (Ray versions that read it; Ray 2.60 takes the interval from the deployment's
        # autoscaling config: the tests' autoscaled tiers set `metrics_interval_s=1`.)
        patch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
        # A replica that cannot start fails its deploy at the first try (Serve's default is
        # three per replica: the failing tier's test would wait for three starts that fail).
        patch.setenv("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
        local = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "resources": {"prefill_node": 2, "decode_node": 1}, **node},
        )
        local.add_node(num_cpus=2, resources={"decode_node": 1, "encoder_node": 1}, **node)
    ray.init(address=local.address, logging_level="warning", log_to_driver=False)
    try:
        yield local.address
    finally:  # Serve goes with the cluster
        ray.shutdown()
        local.shutdown()


@pytest.fixture(scope="module")
def secrets_env() -> dict[str, str]:
    """The deployment's secrets, set in `up`'s environment so that running `up --ray` again
    (to scale) keeps the replicas' environment, and so that the test can call the engines."""
    from tests.ray.ray_helpers import API_KEY  # it skips a module when Ray is not installed

    return {
        "SPLITSERVE_INTERNAL_TOKEN": secrets.token_urlsafe(16),
        "SPLITSERVE_STATE_KEY": "ab" * 32,
        "SPLITSERVE_API_KEY": API_KEY,
    }
