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


def test_small_steps_run_on_one_thread_and_compute_the_same_tokens(tiny_model):
    """`--serial-step-tokens`: a decode step of a few sequences runs on one thread, a
    prefill chunk on all of torch's; the tokens do not depend on it."""
    import torch

    from splitserve.engine.llm import LLM
    from splitserve.protocol.sampling_params import SamplingParams

    assert parse("--serial-step-tokens", "0").serial_step_tokens == 0
    assert parse().serial_step_tokens == ModelConfig.serial_step_tokens
    with pytest.raises(SystemExit):
        parse("--serial-step-tokens", "-1")
    assert engine_cli.engine_config(parse("--serial-step-tokens", "3"), "/m").model.serial_step_tokens == 3

    all_threads = torch.get_num_threads()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 45)), list(range(7, 30))]
    try:
        serial = LLM(tiny_model, num_blocks=64, serial_step_tokens=8)
        first = serial.generate(prompts, params)
        assert torch.get_num_threads() == 1  # the last step decoded 2 sequences
        serial.generate([list(range(3, 90))], SamplingParams(max_tokens=1, temperature=0.0))
        assert torch.get_num_threads() == all_threads  # an 87-token prefill step
        parallel = LLM(tiny_model, num_blocks=64, serial_step_tokens=0)
        torch.set_num_threads(all_threads)
        assert [r.token_ids for r in parallel.generate(prompts, params)] == [r.token_ids for r in first]
        assert torch.get_num_threads() == all_threads
    finally:
        torch.set_num_threads(all_threads)
