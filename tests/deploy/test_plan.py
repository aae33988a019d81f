"""The deployment plan: the command line each tier gets from `up`'s flags, and that `up`
and `up --ray` give a tier the same one (pure: nothing is started)."""

from __future__ import annotations

import argparse
import os

import pytest

from splitserve.deploy import up_cli
from splitserve.deploy.plan import DeploymentPlan, deployment_secrets, plan_from_args, tier_env
from splitserve.deploy.up_afd import afd_flag_error
from splitserve.ray_serve.config import config_from_args, with_transport
from splitserve.ray_serve.tier import server_command
from splitserve.runtime.access import API_KEY_ENV, INTERNAL_TOKEN_ENV


def up_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up_cli.add_arguments(parser)
    return parser.parse_args(["/models/m", *flags])


def plan(*flags: str) -> DeploymentPlan:
    return plan_from_args(up_args(*flags), "/models/m", "m")


def flag_value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_tier_gets_its_command_and_the_flags_meant_for_it():
    tiers = plan("--transport", "tcp", "--mode", "pull", "--num-blocks", "512", "--routing", "round-robin")
    render, prefill, decode, encoder, proxy = (
        tiers.tier(r) for r in ("render", "prefill", "decode", "encoder", "proxy")
    )
    assert (
        render.argv[:2] == ("render", "/models/m") and flag_value(render.argv, "--served-model-name") == "m"
    )
    for engine in (prefill, decode):
        assert engine.argv[:4] == ("engine", "/models/m", "--role", engine.role) and engine.moves_kv
        assert (flag_value(engine.argv, "--kv-mode"), flag_value(engine.argv, "--kv-transport")) == (
            "pull",
            "tcp",
        )
        assert flag_value(engine.argv, "--num-blocks") == "512"
    assert "--kv-mode" not in encoder.argv and "--kv-transport" not in encoder.argv and not encoder.moves_kv
    assert flag_value(encoder.argv, "--num-blocks") == "512"
    assert proxy.argv[0] == "proxy" and flag_value(proxy.argv, "--routing") == "round-robin"
    assert flag_value(proxy.argv, "--mode") == "pull" and "--num-blocks" not in proxy.argv
    assert "--routing" not in render.argv + prefill.argv  # a proxy flag goes to the proxy only
    for tier in tiers.tiers:  # placement is the launcher's
        assert "--host" not in tier.argv and "--port" not in tier.argv


@pytest.mark.parametrize(
    ("flags", "tier", "present", "absent"),
    [
        ((), "render", [], ["--max-model-len", "--trust-request-chat-template"]),
        (("--max-model-len", "4096"), "render", ["--max-model-len"], []),
        (("--max-model-len", "4096"), "decode", ["--max-model-len"], []),
        (("--trust-request-chat-template",), "render", ["--trust-request-chat-template"], []),
        (("--no-kv-bidirectional", "--open-health-metrics"), "proxy",
         ["--no-kv-bidirectional", "--open-health-metrics"], []),
        ((), "proxy", ["--pd-decision"], ["--no-kv-bidirectional", "--quota-by", "--routing"]),
        (("--quota-by", "address", "api-key"), "proxy", ["--quota-by"], []),
        (("--dtype", "bfloat16"), "prefill", ["--dtype"], []),
        ((), "prefill", ["--kv-mode"], ["--kv-transport", "--dtype", "--quantization"]),
        (("--quantization", "none"), "decode", ["--quantization"], []),
    ],
)  # fmt: skip
def test_a_flag_reaches_its_tier_only_when_given(flags, tier, present, absent):
    argv = plan(*flags).tier(tier).argv
    assert all(flag in argv for flag in present) and not any(flag in argv for flag in absent), argv


def test_engines_chunk_a_local_prefill_beside_decodes_by_default():
    """`up`'s engines get --long-prefill-token-threshold 32 unless told otherwise (0: off)."""
    assert flag_value(plan().tier("decode").argv, "--long-prefill-token-threshold") == "32"
    off = plan("--long-prefill-token-threshold", "0").tier("decode").argv
    assert flag_value(off, "--long-prefill-token-threshold") == "0"
    assert "--long-prefill-token-threshold" not in plan().tier("proxy").argv


def test_quota_by_keeps_every_value_and_the_cost_profile_is_an_absolute_path():
    proxy = plan("--quota-by", "address", "api-key", "--pd-cost-profile", "costs.json").tier("proxy").argv
    assert proxy[proxy.index("--quota-by") + 1 : proxy.index("--quota-by") + 3] == ("address", "api-key")
    assert flag_value(proxy, "--pd-cost-profile").startswith("/")


def test_part_names_follow_the_replica_counts_in_start_order():
    assert plan().part_names() == ["render", "prefill-0", "decode-0", "proxy"]
    names = plan("--render", "2", "--prefill", "0", "--decode", "2", "--encoder", "1").part_names()
    assert names == ["render-0", "render-1", "decode-0", "decode-1", "encoder-0", "proxy"]


def test_up_afd_adds_ffn_daemons_before_the_engines_with_the_engines_dtype():
    args = up_args("--afd", "2:1", "--dtype", "bfloat16")
    assert afd_flag_error(args) is None and args.decode == 2
    tiers = plan_from_args(args, "/models/m", "m")
    assert tiers.part_names() == ["render", "ffn-0", "prefill-0", "decode-0", "decode-1", "proxy"]
    ffn = tiers.tier("ffn").argv
    assert ffn[:4] == ("engine", "/models/m", "--role", "ffn") and flag_value(ffn, "--dtype") == "bfloat16"
    assert tiers.tier("ffn").secret_names == (INTERNAL_TOKEN_ENV,)
    assert "ffn" not in [t.role for t in plan().tiers]


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--transport", "shm", "--mode", "pull", "--max-model-len", "2048", "--kv-timeout", "9"),
        (
            "--trust-request-chat-template",
            "--reasoning-parser",
            "none",
            "--max-pixel-bytes-per-request",
            "1024",
        ),
    ],
)
def test_up_and_up_ray_give_every_server_tier_the_same_command_line(flags):
    args = up_args("--served-model-name", "m", *flags)
    local = plan_from_args(args, args.model, args.served_model_name)
    ray = config_from_args(args).server()
    for role in ("render", "prefill", "decode", "encoder"):
        assert ray.tier(role) == local.tier(role)


def test_a_ray_replica_adds_its_placement_to_the_plan():
    server = with_transport(config_from_args(up_args("--encoder", "1"))).server()
    ec = ["--ec-remote", "10.0.0.2:7000"]
    decode = server_command(server, "decode", "10.0.0.1", [8001, 8002, 8003], "node-a", ec)
    assert decode[: len(server.tier("decode").argv)] == list(server.tier("decode").argv)
    assert (
        flag_value(tuple(decode), "--kv-transport") == "auto"
        and flag_value(tuple(decode), "--kv-node-id") == "node-a"
    )
    assert flag_value(tuple(decode), "--kv-events-replay-endpoint") == "tcp://10.0.0.1:8003"
    assert "--ec-remote" in decode
    render = server_command(server, "render", "10.0.0.1", [8001, 8002, 8003], "node-a", ec)
    assert render[-4:] == ["--host", "10.0.0.1", "--port", "8001"] and "--ec-remote" not in render
    encoder = server_command(server, "encoder", "10.0.0.1", [8001, 8002, 8003], "node-a", ec)
    assert (
        "--kv-events-endpoint" not in encoder and "--kv-node-id" not in encoder and "--ec-remote" in encoder
    )


def test_a_ray_kv_store_replica_and_its_engines_get_their_addresses(tmp_path, monkeypatch):
    flags = ("--kv-store", "--kv-store-ram-gb", "0.5", "--kv-store-disk", "kv", "--kv-store-disk-gb", "2")
    monkeypatch.chdir(tmp_path)  # a relative disk directory is made absolute where `up` runs
    args = up_args(*flags)
    server = with_transport(config_from_args(args)).server()
    local = plan_from_args(args, args.model, args.served_model_name).tier("kvstore")
    store = server.tier("kvstore")
    # the sizes `up` gives its store (which also gets up's drain timeout)
    assert store.argv == local.argv[: local.argv.index("--drain-timeout")]
    assert flag_value(store.argv, "--kv-store-disk") == str(tmp_path / "kv")
    assert store.secret_names == (INTERNAL_TOKEN_ENV,) and server.kv_store
    command = server_command(server, "kvstore", "10.0.0.3", [9000, 9001, 9002, 9003], "node-b", [])
    assert command[len(store.argv) :] == [
        "--host", "10.0.0.3", "--port", "9000", "--kv-port", "9001",
        "--kv-events-endpoint", "tcp://10.0.0.3:9002", "--kv-events-replay-endpoint", "tcp://10.0.0.3:9003",
    ]  # fmt: skip
    ports = [8001, 8002, 8003]
    for role in ("prefill", "decode"):
        engine = server_command(server, role, "10.0.0.1", ports, "node-a", [], store_address="10.0.0.3:9001")
        assert flag_value(tuple(engine), "--kv-store") == "10.0.0.3:9001"
    encoder = server_command(
        server, "encoder", "10.0.0.1", ports, "node-a", [], store_address="10.0.0.3:9001"
    )
    assert "--kv-store" not in encoder
    without = with_transport(config_from_args(up_args())).server()
    assert not without.kv_store and "--kv-store" not in server_command(
        without, "decode", "10.0.0.1", ports, "node-a", []
    )


def test_secrets_go_by_name_to_the_tiers_that_need_them():
    tiers = plan()
    values = deployment_secrets("key-1,key-2")
    assert set(tier_env(tiers.tier("proxy"), values)) == {INTERNAL_TOKEN_ENV, API_KEY_ENV}
    assert set(tier_env(tiers.tier("decode"), values)) == {INTERNAL_TOKEN_ENV}
    assert API_KEY_ENV not in tier_env(tiers.tier("proxy"), deployment_secrets(None))
    for tier in tiers.tiers:  # never on a command line
        assert not set(values.values()) & set(tier.argv)


def test_up_lends_each_pinned_decode_to_the_pinned_prefill_unless_told_not_to():
    from splitserve.deploy.cpu_affinity import parse_cpu_affinity
    from splitserve.deploy.local_stack import LocalStack
    from splitserve.deploy.plan import part_names, up_replicas

    args = up_args("--prefill", "1", "--decode", "2", "--cpu-affinity", "prefill=0,decode-0=1,decode-1=2")
    assert args.no_lend_idle_cpus is False and up_args("--no-lend-idle-cpus").no_lend_idle_cpus
    names = part_names(up_replicas(args))
    pinned = parse_cpu_affinity(args.cpu_affinity, names, available=frozenset({0, 1, 2}))
    secrets = deployment_secrets(None)
    stack = LocalStack(plan("--prefill", "1", "--decode", "2"), secrets, pinned, "127.0.0.1", 8000)
    flags = stack.lending_flags()
    try:
        (directory,) = stack.cleanup  # one directory of this run, removed when it stops
        lend = {name: flags[name] for name in ("decode-0", "decode-1")}
        assert lend == {name: ["--lend-idle-cpus", f"{directory}/{name}"] for name in lend}
        assert flags["prefill-0"] == ["--borrow-idle-cpus", f"{directory}/decode-0", f"{directory}/decode-1"]
        assert "render" not in flags
    finally:
        for path in stack.cleanup:
            os.rmdir(path)
    off = LocalStack(plan("--prefill", "1", "--decode", "2"), secrets, pinned, "127.0.0.1", 8000, False)
    assert off.lending_flags() == {} and off.cleanup == []


def test_engines_sharing_the_cores_run_small_steps_on_one_thread():
    from splitserve.deploy.cpu_affinity import parse_cpu_affinity
    from splitserve.deploy.local_stack import LocalStack
    from splitserve.deploy.plan import part_names, up_replicas

    secrets = deployment_secrets(None)
    shared = LocalStack(plan("--prefill", "1", "--decode", "2"), secrets, {}, "127.0.0.1", 8000, False)
    serial = ["--serial-step-tokens", "8"]
    assert shared.thread_flags() == {"prefill-0": serial, "decode-0": serial, "decode-1": serial}
    alone = LocalStack(plan("--prefill", "0", "--decode", "1"), secrets, {}, "127.0.0.1", 8000, False)
    assert alone.thread_flags() == {}  # a serve-like stack: every step on all threads
    args = up_args("--prefill", "1", "--decode", "1", "--cpu-affinity", "prefill=0")
    pinned = parse_cpu_affinity(args.cpu_affinity, part_names(up_replicas(args)), available=frozenset({0, 1}))
    partly = LocalStack(plan("--prefill", "1", "--decode", "1"), secrets, pinned, "127.0.0.1", 8000, False)
    assert partly.thread_flags() == {"decode-0": serial}  # the pinned engine has its core
