"""The Ray deployment's config: from YAML or `up`'s flags, and the errors that stop
`splitserve up --ray` before it connects to anything (no Ray needed for these)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.config import UP_LONG_PREFILL_TOKEN_THRESHOLD
from splitserve.deploy.up_afd import afd_flag_error
from splitserve.ray_serve.app import deployment_options
from splitserve.ray_serve.checks import check, check_cluster
from splitserve.ray_serve.cli import ray_address
from splitserve.ray_serve.config import (
    ConfigError,
    config_from_args,
    config_from_mapping,
    load_yaml,
    planner_from_args,
)
from splitserve.ray_serve.tier import server_command
from tests.deploy.test_plan import flag_value, up_args

GOOD = """
model: Qwen/Qwen3-0.6B
http_host: 0.0.0.0
engine_args: ["--num-blocks", "4096"]
tiers:
  render: {replicas: 2, num_cpus: 2}
  prefill: {replicas: 1, num_gpus: 1, resources: {a100: 1}}
  decode: {replicas: 2, num_gpus: 1, min_replicas: 1, max_replicas: 4, target: 0.6}
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ray.yaml"
    path.write_text(text)
    return str(path)


def test_a_yaml_config_reads_and_checks(tmp_path):
    config = load_yaml(write(tmp_path, GOOD))
    check(config)
    decode = config.tier("decode")
    assert decode.autoscaling and (decode.lowest_replicas, decode.max_replicas, decode.target) == (1, 4, 0.6)
    assert config.tier("prefill").demand() == {"CPU": 1.0, "GPU": 1.0, "a100": 1.0}
    assert config.tier("encoder").replicas == 0 and config.engine_args == ("--num-blocks", "4096")
    gpu_node = {"CPU": 8.0, "GPU": 1.0, "a100": 1.0}
    check_cluster(config, [{"CPU": 16.0}, gpu_node])
    with pytest.raises(ConfigError, match=r"prefill: no node in the cluster has CPU=1, GPU=1, a100=1"):
        check_cluster(config, [{"CPU": 16.0}, {"CPU": 8.0, "GPU": 1.0}])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tiers: {render: {}, decode: {}, gpu: {}}", "unknown tier 'gpu'"),
        ("tiers: {render: {}, decode: {replicas: 0}}", "decode: needs at least 1 replica"),
        ("tiers: {decode: {}}", "render: needs at least 1 replica"),
        ("tiers: {render: {}, decode: {num_gpu: 1}}", "tiers.decode: unknown key(s) num_gpu"),
        ("tiers: {render: {}, decode: {replicas: -1}}", "tiers.decode.replicas: expected a whole number"),
        ("tiers: {render: {}, decode: {replicas: 3, max_replicas: 2}}", "within min_replicas"),
        ("tiers: {render: {}, decode: {}}\ntransport: rdma", "transport: shm, tcp, auto or unset"),
        ("replicas: 3", "unknown key(s) replicas"),
        ("- a list", "must be a mapping"),
        ("tiers: {render: {}, decode: {}}\nmode: both", "mode: push or pull"),
        ("tiers: {render: {}, decode: {}}\nplanner: {}", "planner: the decode tier needs autoscaling bounds"),
        (
            "tiers: {render: {}, decode: {max_replicas: 2}, prefill: {replicas: 0, max_replicas: 1}}\n"
            "planner: {}",
            "planner: prefill needs min_replicas >= 1",
        ),
        ("tiers: {render: {}, decode: {max_replicas: 2}}\nplanner: {slo: 1}", "planner: unknown key(s) slo"),
        ("tiers: {render: {}, decode: {max_replicas: 2}}\nplanner: [1]", "planner: expected a mapping"),
        ("tiers: {render: {}, decode: {max_replicas: 2}}\nplanner: {target: 2}", "planner.target must be"),
        ("tiers: {render: {}, decode: {metrics_interval_s: 0}}", "decode.metrics_interval_s: must be >="),
        ("tiers: {render: {}, decode: {}, ffn: {max_replicas: 2}}", "ffn: the FFN daemons do not autoscale"),
        ("tiers: {render: {}, decode: {}, ffn: {}, encoder: {}}", "not with an encoder tier"),
        ("tiers: {render: {}, decode: {}, kvstore: {replicas: 2}}", "kvstore: one replica"),
        ("tiers: {render: {}, decode: {}, kvstore: {max_replicas: 2}}", "kvstore: one replica"),
        (
            "tiers: {render: {}, decode: {}}\nkv_store_ram_gb: 8",
            "need the KV store (--kv-store; tiers.kvstore)",
        ),
        (
            "tiers: {render: {}, decode: {}, kvstore: {}}\nkv_store_ram_gb: 0",
            "--kv-store-ram-gb must be a positive",
        ),
        (
            "tiers: {render: {}, decode: {}, kvstore: {}}\nkv_store_ram_gb: lots",
            "kv_store_ram_gb: expected a number",
        ),
        ("tiers: {render: {}, decode: {}, kvstore: {}}\nkv_store_disk: /d", "--kv-store-disk-gb go together"),
        (
            "tiers: {render: {}, decode: {}, kvstore: {}}\nkv_store_disk: kv\nkv_store_disk_gb: 1",
            "kv_store_disk: an absolute path on the store's node, not 'kv'",
        ),
    ],
)
def test_config_errors_name_what_to_change(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        check(load_yaml(write(tmp_path, text)))
    assert message in str(error.value)


def test_an_autoscaled_tier_reports_its_load_signal_at_its_metrics_interval(tmp_path):
    """`metrics_interval_s` is how often Serve takes each replica's load signal (a tier
    key, not a custom resource); unset, Serve's own default stands."""
    flag = "decode:max_replicas=2,metrics_interval_s=1"
    decode = config_from_args(up_args("--ray", "auto", "--ray-tier", flag)).tier("decode")
    assert decode.resources == () and decode.metrics_interval_s == 1.0
    assert deployment_options("decode", decode, {})["autoscaling_config"]["metrics_interval_s"] == 1.0
    default = load_yaml(write(tmp_path, GOOD)).tier("decode")
    assert "metrics_interval_s" not in deployment_options("decode", default, {})["autoscaling_config"]


def test_up_ray_afd_plans_an_ffn_tier_whose_daemons_the_decode_replicas_call():
    """`up --ray --afd 2:1`: the decode tier is 2 attention engines, the ffn tier 1 FFN
    daemon (placed like any tier, never autoscaled); a decode replica's engine gets the
    daemon's address Serve handed it and picks shm or tcp by where that daemon is; the
    daemon's replica runs `engine --role ffn` on its own address, with no KV flags; the
    prefill engines keep their experts."""
    args = up_args(
        "--ray", "auto", "--afd", "2:1", "--prefill", "1", "--ray-tier", "ffn:num_cpus=2,ffn_node=1"
    )
    assert afd_flag_error(args) is None
    config = config_from_args(args)
    check(config)
    assert (config.tier("decode").replicas, config.tier("ffn").replicas) == (2, 1)
    assert config.tier("ffn").demand() == {"CPU": 2.0, "ffn_node": 1.0}
    assert deployment_options("ffn", config.tier("ffn"), {})["num_replicas"] == 1
    server = config.server()
    assert server.afd and server.tier("ffn").argv[:4] == ("engine", "/models/m", "--role", "ffn")
    decode = server_command(
        server, "decode", "10.0.0.2", [8100, 8101, 8102], "node-a", [], ffn_address="10.0.0.3:9100"
    )
    assert flag_value(decode, "--ffn-address") == "10.0.0.3:9100"
    assert flag_value(decode, "--afd-transport") == "auto"  # shm only with a daemon on this host
    daemon = server_command(server, "ffn", "10.0.0.3", [9100, 9101, 9102], "node-b", [])
    assert daemon[-4:] == ["--host", "10.0.0.3", "--port", "9100"]
    assert "--kv-node-id" not in daemon and "--ffn-address" not in daemon
    prefill = server_command(server, "prefill", "10.0.0.2", [8200, 8201, 8202], "node-a", [])
    assert "--ffn-address" not in prefill
    # without --afd: no ffn tier, no daemon
    plain = config_from_args(up_args("--ray", "auto"))
    assert plain.tier("ffn").replicas == 0 and not plain.server().afd
    assert all(tier.role != "ffn" for tier in plain.server().tiers)


def up_ray_exit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`splitserve up --ray` at an address where no cluster runs, in this process (a
    fresh interpreter per case cost 0.5 s each): its exit status and stderr."""
    try:
        status = main(["up", "--ray", "127.0.0.1:1", *args])
    except SystemExit as exited:  # argparse's errors
        status = exited.code
    return status, capsys.readouterr().err


def test_up_ray_stops_on_a_bad_config_before_connecting(tmp_path, capsys):
    """No cluster runs at this address: the config error comes first, with no traceback
    (the first case through the real command line, the others through `main`)."""
    bad = write(tmp_path, "tiers: {render: {}, decode: {replicas: 0}}")
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "up", "--ray", "127.0.0.1:1", "--ray-config", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "decode: needs at least 1 replica" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for args, message in (
        (["--ray-config", str(tmp_path / "missing.yaml")], "cannot read"),
        (["--ray-tier", "decode:num_gpus"], "is not KEY=NUMBER"),
        (["--ray-tier", "gpu:num_gpus=1"], "unknown tier 'gpu'"),
        (["--decode", "0"], "decode: needs at least 1 replica"),
        (["--ray-tier", "decode:max_replicas=1,min_replicas=2"], "min_replicas"),
        (["--ray", "http://head:8265"], "expected auto, HOST:PORT or ray://HOST[:PORT]"),
        (["--ray-planner"], "planner: the decode tier needs autoscaling bounds"),
        (
            [
                "--ray-planner",
                "--ray-tier",
                "decode:max_replicas=2",
                "--profile",
                str(tmp_path / "none.json"),
            ],
            "no such file",
        ),
        (["--lengths", "256/64"], "--lengths: only with --plan"),
        (["--ray-tier", "kvstore:num_cpus=1"], "the kvstore tier runs with --kv-store only"),
        (["--kv-store", "--kv-store-disk-gb", "2"], "--kv-store-disk and --kv-store-disk-gb go together"),
        (["--kv-store", "--ray-tier", "kvstore:max_replicas=2"], "kvstore: one replica"),
    ):
        status, stderr = up_ray_exit(args, capsys)
        assert status == 2 and message in stderr and "Traceback" not in stderr, (args, stderr)


def test_a_yaml_kv_store_tier_reads_and_gets_its_sizes(tmp_path):
    text = "tiers: {render: {}, decode: {}, kvstore: {num_cpus: 0.5, resources: {cpu_node: 1}}}\n"
    text += "kv_store_ram_gb: 8\nkv_store_disk: /var/kv\nkv_store_disk_gb: 100\n"
    config = load_yaml(write(tmp_path, text))
    check(config)
    assert config.tier("kvstore").demand() == {"CPU": 0.5, "cpu_node": 1.0}
    server = config.server()
    assert server.kv_store and server.tier("kvstore").argv == (
        "kvstore", "--log-level", "warning",
        "--kv-store-ram-gb", "8.0", "--kv-store-disk", "/var/kv", "--kv-store-disk-gb", "100.0",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"kvstore: no node in the cluster has CPU=0.5, cpu_node=1"):
        check_cluster(config, [{"CPU": 16.0}])
    plain = load_yaml(write(tmp_path, "tiers: {render: {}, decode: {}}"))
    assert not plain.server().kv_store and "kvstore" not in [t.role for t in plain.server().tiers]


def test_a_yaml_planner_reads_its_slos_and_interval(tmp_path):
    text = "tiers: {render: {}, decode: {max_replicas: 2}}\n"
    text += "planner: {interval_s: 5, slo_ttft: 2, slo_gap: 0.2, target: 0.95}"
    config = load_yaml(write(tmp_path, text))
    check(config)
    planner = config.planner
    assert planner is not None and (planner.interval_s, planner.target, planner.profile) == (5.0, 0.95, None)
    assert [(slo.ttft, slo.tpot, slo.gap) for slo in planner.slos] == [(2.0, None, 0.2)]
    assert load_yaml(write(tmp_path, "tiers: {render: {}, decode: {}}")).planner is None
    # it plans with the long-prefill threshold the engines run: engine_args', else none
    assert planner.long_prefill_token_threshold == 0
    for args, threshold in (
        (["--long-prefill-token-threshold", "48"], 48),
        (["--long-prefill-token-threshold=8"], 8),
    ):
        given = load_yaml(write(tmp_path, f"{text}\nengine_args: {args}"))
        assert given.planner is not None and given.planner.long_prefill_token_threshold == threshold
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold: expected a whole number"):
        load_yaml(write(tmp_path, f"{text}\nengine_args: [--long-prefill-token-threshold, many]"))
    # `up --ray --ray-planner`'s flags: up's (32) unless given
    flags = ["--ray", "auto", "--ray-planner", "--ray-tier", "decode:max_replicas=2"]
    assert planner_from_args(up_args(*flags)).long_prefill_token_threshold == UP_LONG_PREFILL_TOKEN_THRESHOLD
    told = planner_from_args(up_args(*flags, "--long-prefill-token-threshold", "16"))
    assert told.long_prefill_token_threshold == 16


def test_the_ray_planner_needs_ray():
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "up", "--ray-planner"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--ray-planner plans a Ray deployment: only with --ray" in done.stderr


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("auto", "auto"),
        ("10.0.0.1:6379", "10.0.0.1:6379"),
        ("ray://head", "ray://head:10001"),  # Ray Client's default port
        ("ray://head:10002", "ray://head:10002"),
        ("ray://[fd00::1]", "ray://[fd00::1]:10001"),
        ("[fd00::1]:6379", "[fd00::1]:6379"),
    ],
)
def test_ray_addresses_read(text, address):
    assert ray_address(text) == address


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ray://", "expected auto, HOST:PORT or ray://HOST[:PORT]"),
        ("http://head:8265", "expected auto"),
        ("ray://head:0", "expected auto"),
        ("ray://head:10001/path", "expected auto"),
        ("head:port", "expected auto"),
        ("head", "a GCS address needs its port"),
    ],
)
def test_bad_ray_addresses_are_refused_before_connecting(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ray_address(text)


def test_down_needs_ray():
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "down"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--ray" in done.stderr


def test_the_kuberay_manifest_deploys_a_valid_config():
    import importlib

    import yaml

    manifest = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "kuberay-rayservice.yaml").read_text())
    application = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]
    config = config_from_mapping(application["args"])
    check(config)
    assert config.app_name == application["name"]  # replicas find the ingress by the app's name
    module, _, name = application["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    # `rayStartParams.resources` is a quoted JSON string: '"{\\"cpu_node\\": 1}"'
    resources = [g["rayStartParams"]["resources"].strip('"').replace('\\"', '"') for g in groups]
    offered = [yaml.safe_load(text) for text in resources]
    for tier in ("render", "prefill", "decode"):  # each tier's custom resource has a worker group
        assert any(set(dict(config.tier(tier).resources)) <= set(node) for node in offered), tier
