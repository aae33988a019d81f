"""The engine's config decides its KV transport when it is built, from the device."""

from __future__ import annotations

import argparse

import pytest

from splitserve.config import EngineConfig, ModelConfig, TransferConfig
from splitserve.engine.api import cli as engine_cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_gpu_p_d_engine_gets_tcp_or_a_clear_error_naming_it():
    decode_on_gpu = engine_cli.engine_config(parse("--role", "decode", "--device", "cuda"), "/m")
    assert decode_on_gpu.transfer.transport == "tcp"
    on_cpu = engine_cli.engine_config(parse("--role", "decode", "--device", "cpu"), "/m")
    assert on_cpu.transfer.transport == "shm"
    with pytest.raises(ValueError, match="--kv-transport tcp"):
        shm_on_gpu = parse("--role", "prefill", "--device", "cuda", "--kv-transport", "shm")
        engine_cli.engine_config(shm_on_gpu, "/m")
    with pytest.raises(ValueError, match="--kv-transport tcp"):
        shm = TransferConfig(transport="shm")
        EngineConfig(ModelConfig("/m", device="cuda:1"), role="decode", transfer=shm)
    # a collocated engine moves no KV: any device, any transport setting
    assert EngineConfig(ModelConfig("/m", device="cuda"), role="both").role == "both"
