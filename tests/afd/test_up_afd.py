"""`splitserve up MODEL --afd A:F`: the decode side as A attention engines sharing F FFN
daemons answers `serve`'s greedy tokens, with P/D in front (`--prefill 1`: long prompts
are prefilled there and handed to an attention engine, short ones prefilled on it) and
without (`--prefill 0`); the tensors through shared memory (`1:1`, up's default) and over
tcp (`2:1`); two attention engines use one daemon at once; the attention engines'
/metrics carry the traffic per step, the bytes exactly the tensors' either way; a daemon
SIGKILLed mid-stream is started again by `up` and the streams go on, equal to the
undisturbed run, over tcp and over shm; so does the stream of a daemon SIGSTOPped
mid-stream (alive, silent), well inside the old 30 s layer timeout. The stacks start
side by side (their start-ups are most of the time)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from splitserve.cli import main
from splitserve.deploy.plan import plan_from_args
from splitserve.deploy.up_afd import afd_flag_error
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from tests.conftest import free_port, running_servers, wait_until
from tests.deploy.test_plan import flag_value, up_args
from tests.router.test_migration import Stream
from tests.router.test_pd_proxy import metric, up_log

TOKEN = "up-afd-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
SHORT = "the attention side"  # under --min-prefill-tokens: prefilled on the attention engine
LONG = " ".join(f"word{i} and the experts of layer {i}" for i in range(12))  # through the prefill engine
LONG_STREAM = {**GREEDY, "prompt": SHORT, "max_tokens": 400}
ENGINE_FLAGS = ["--num-blocks", "256", "--max-model-len", "2048"]
# long prompts through the prefill engine, short ones prefilled on the attention engine
PD_FLAGS = ["--pd-decision", "threshold", "--min-prefill-tokens", "16", "--routing", "round-robin"]


@dataclass
class Stacks:
    serve: str
    one_to_one: str  # up --afd 1:1 --prefill 0 (shm, up's default)
    one_to_one_port: int
    two_to_one: str  # up --afd 2:1 --prefill 1 --afd-microbatches 2 --afd-transport tcp
    two_to_one_port: int

    def port_of(self, name: str) -> int:
        return {"one_to_one": self.one_to_one_port, "two_to_one": self.two_to_one_port}[name]


@pytest.fixture(scope="module")
def moe(tiny_model_factory) -> str:
    return tiny_model_factory(arch="qwen3_moe", layers=4, dtype="bfloat16")


@pytest.fixture(scope="module")
def stacks(moe) -> Iterator[Stacks]:
    serve, one, two = free_port(), free_port(), free_port()
    servers = [
        (["serve", moe, "--port", str(serve), *ENGINE_FLAGS], serve),
        (["up", moe, "--port", str(one), "--afd", "1:1", "--prefill", "0", *ENGINE_FLAGS], one),
        (
            [
                "up",
                moe,
                "--port",
                str(two),
                "--afd",
                "2:1",
                "--prefill",
                "1",
                "--afd-microbatches",
                "2",
                "--afd-transport",
                "tcp",
                *ENGINE_FLAGS,
                *PD_FLAGS,
            ],
            two,
        ),
    ]
    with running_servers(servers, timeout=240, env={INTERNAL_TOKEN_ENV: TOKEN}) as (s, a, b):
        assert wait_until(lambda: all("OpenAI API:" in up_log(p) for p in (one, two)), 60)
        yield Stacks(s, a, one, b, two)


@pytest.fixture(scope="module")
def long_expected(stacks: Stacks) -> list[int]:
    """`serve`'s greedy tokens of LONG_STREAM, the undisturbed run every fault test's
    streams must equal: asked once for the module (the same greedy body to the same
    collocated server answers the same tokens), not once per test."""
    (expected,) = [s.token_ids for s in streamed(stacks.serve, [LONG_STREAM])]
    return expected


def streamed(base: str, bodies: list[dict]) -> list[Stream]:
    """The completions of `bodies`, all at once."""
    streams = [Stream(base, body) for body in bodies]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.join()
        assert stream.error is None and stream.finish_reason == "length", stream.error
    return streams


def token_ids(base: str, prompts: list[str]) -> list[list[int]]:
    return [s.token_ids for s in streamed(base, [{**GREEDY, "prompt": p} for p in prompts])]


def parts(port: int) -> dict[str, tuple[str, int]]:
    """`up`'s parts as it printed them: name -> (url, pid)."""
    found = re.findall(r"^\s+(\S+)\s+(\S+://\S+)\s+\(pid (\d+)\)", up_log(port), re.M)
    return {name: (url, int(pid)) for name, url, pid in found}


def assert_step_traffic(text: str, shm: bool) -> None:
    """An attention engine's /metrics: per step, the tensors each way, exactly (bf16,
    hidden 64, top-2: a token's routing pair goes out as int32 ids and bf16 weights),
    whichever path they took."""
    assert metric(text, "splitserve_afd_step_bytes_sent_count") > 0
    assert metric(text, "splitserve_afd_step_exposed_communication_seconds_count") > 0
    routed = sum(metric(text, "splitserve_afd_step_expert_tokens_sum", f'{{expert="{e}"}}') for e in range(8))
    assert routed > 0
    received = metric(text, "splitserve_afd_step_bytes_received_sum")
    sent = metric(text, "splitserve_afd_step_bytes_sent_sum")
    assert received == routed / 2 * 64 * 2  # the combined output [T, H]
    if metric(text, "splitserve_afd_layers_resent_total") == 0:  # a layer sent again counts twice
        assert sent == received + routed * (4 + 2)  # hidden states, then the routing
    else:
        assert sent > received + routed * (4 + 2)
    assert (metric(text, "splitserve_afd_shm_layers_total") > 0) == shm


def current_daemon(port: int) -> tuple[int, int]:
    """The pid of `up`'s ffn-0 now (the latest it started) and how often it was restarted."""
    log = up_log(port)
    restarts = re.findall(r"ffn-0 started again \(pid (\d+)\)", log)
    return (int(restarts[-1]) if restarts else parts(port)["ffn-0"][1]), len(restarts)


def test_up_afd_equals_serve_with_and_without_pd(stacks: Stacks):
    prompts = [SHORT, LONG]
    expected = token_ids(stacks.serve, prompts)
    assert token_ids(stacks.one_to_one, prompts) == expected  # over shm
    # both attention engines at once (round robin), both on the one daemon; the long
    # prompts through the prefill engine, the short ones prefilled on the attention side
    assert token_ids(stacks.two_to_one, prompts * 2) == expected * 2  # over tcp
    one = parts(stacks.one_to_one_port)
    assert_step_traffic(httpx.get(f"{one['decode-0'][0]}/metrics", headers=AUTH, timeout=10).text, shm=True)
    names = parts(stacks.two_to_one_port)
    assert {"ffn-0", "prefill-0", "decode-0", "decode-1"} <= set(names)
    for name in ("decode-0", "decode-1"):
        assert_step_traffic(httpx.get(f"{names[name][0]}/metrics", headers=AUTH, timeout=10).text, shm=False)
    prefill = httpx.get(f"{names['prefill-0'][0]}/metrics", headers=AUTH, timeout=10).text
    assert "splitserve_afd_step_bytes_sent" not in prefill  # the prefill engine holds its experts
    assert metric(prefill, "splitserve_prompt_tokens_total") > 0  # the long prompts went through P/D


@pytest.mark.parametrize(
    ("stack", "engines"), [("two_to_one", ("decode-0", "decode-1")), ("one_to_one", ("decode-0",))]
)
def test_a_killed_ffn_daemon_is_restarted_and_the_streams_go_on(
    stacks: Stacks, long_expected: list[int], stack: str, engines
):
    """Every attention engine is mid-stream on the one daemon when it is SIGKILLed: each
    sends its layer again to the daemon `up` starts in its place (over tcp; over shm, with
    a new segment the new daemon maps); nothing ends in error."""
    expected = long_expected
    port = stacks.port_of(stack)
    daemon_pid, restarts = current_daemon(port)
    streams = [Stream(getattr(stacks, stack), LONG_STREAM) for _ in engines]
    for stream in streams:
        stream.start()
    assert wait_until(lambda: all(s.token_ids for s in streams), 60)
    assert all(s.is_alive() for s in streams)  # mid-stream
    os.kill(daemon_pid, signal.SIGKILL)
    for stream in streams:
        stream.join()
        assert stream.error is None and stream.finish_reason == "length", stream.error
        assert stream.token_ids == expected
    assert current_daemon(port)[1] == restarts + 1
    resent = 0.0
    for name in engines:
        text = httpx.get(f"{parts(port)[name][0]}/metrics", headers=AUTH, timeout=10).text
        resent += metric(text, "splitserve_afd_layers_resent_total")
        if stack == "one_to_one":  # the layers after the failover went through shm again
            assert metric(text, "splitserve_afd_shm_layers_total") > 0
    assert resent >= 1


def test_a_stopped_ffn_daemon_is_found_and_replaced_and_the_stream_goes_on(
    stacks: Stacks, long_expected: list[int]
):
    """SIGSTOP (the daemon alive, its port open, nothing answered): the attention engine's
    layer misses its deadline and is sent again on a new connection, `up`'s liveness PING
    finds the daemon silent and has it started again, and the stream finishes equal to
    `serve`'s, long before the old 30 s a layer used to wait."""
    expected = long_expected
    port = stacks.one_to_one_port
    daemon_pid, restarts = current_daemon(port)
    decode = parts(port)["decode-0"][0]
    before = httpx.get(f"{decode}/metrics", headers=AUTH, timeout=10).text  # the kill test's count too
    stream = Stream(stacks.one_to_one, LONG_STREAM)
    stream.start()
    assert wait_until(lambda: stream.token_ids, 60)
    assert stream.is_alive()  # mid-stream
    stopped_at = time.monotonic()
    os.kill(daemon_pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: current_daemon(port)[1] > restarts, timeout_s=25)
        stream.join(timeout=60)
        recovered_s = time.monotonic() - stopped_at
        assert stream.error is None and stream.finish_reason == "length", stream.error
        assert stream.token_ids == expected
        assert recovered_s < 25, recovered_s
        assert "has not answered PING" in up_log(port)
        text = httpx.get(f"{decode}/metrics", headers=AUTH, timeout=10).text
        for name in ("splitserve_afd_deadlines_missed_total", "splitserve_afd_layers_resent_total"):
            assert metric(text, name) > metric(before, name), name
    finally:
        with contextlib.suppress(ProcessLookupError):  # up SIGKILLed it: gone already
            os.kill(daemon_pid, signal.SIGCONT)


def test_up_afd_refuses_a_model_without_moe_layers_and_bad_ratios(tiny_model, capsys):
    """Refused before any part starts, with the reason (exit status 2)."""
    assert main(["up", tiny_model, "--afd", "1:1"]) == 2
    assert "--afd needs a mixture-of-experts model" in capsys.readouterr().err
    for ratio in ("2", "0:1", "a:b"):
        with pytest.raises(SystemExit) as exited:
            main(["up", tiny_model, "--afd", ratio])
        assert exited.value.code == 2 and "--afd" in capsys.readouterr().err
    assert main(["up", tiny_model, "--afd", "2:1", "--decode", "3"]) == 2
    assert "not --decode 3" in capsys.readouterr().err
    assert main(["up", tiny_model, "--afd", "2:1", "--ray", "127.0.0.1:1"]) == 2  # checked before Ray
    assert "--afd needs a mixture-of-experts model" in capsys.readouterr().err
    assert main(["up", tiny_model, "--afd-microbatches", "1"]) == 2
    assert "--afd-microbatches needs --afd" in capsys.readouterr().err
    assert main(["up", tiny_model, "--afd-transport", "tcp"]) == 2
    assert "--afd-transport needs --afd" in capsys.readouterr().err


def test_up_afd_refuses_a_hybrid_model_with_moe_layers(tiny_model_factory, capsys):
    """Nemotron-H's MoE layers run in the engine; the FFN daemon serves Qwen-MoE only."""
    model = tiny_model_factory(arch="nemotron_h", pattern="M-ME*E")
    assert main(["up", model, "--afd", "1:1"]) == 2
    assert "--afd does not split hybrid (Mamba) models yet" in capsys.readouterr().err


def test_up_gives_the_attention_engines_the_micro_batch_and_transport_settings():
    args = up_args("--afd", "1:1", "--afd-microbatches", "1", "--afd-transport", "tcp")
    assert afd_flag_error(args) is None
    decode = plan_from_args(args, "/models/m", "m").tier("decode").argv
    assert flag_value(decode, "--afd-microbatches") == "1"
    assert flag_value(decode, "--afd-transport") == "tcp"
    args = up_args("--afd", "1:1")
    assert afd_flag_error(args) is None
    decode = plan_from_args(args, "/models/m", "m").tier("decode").argv
    assert "--afd-microbatches" not in decode
    assert flag_value(decode, "--afd-transport") == "shm"  # every part on this host
