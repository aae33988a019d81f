"""A KV peer that stops answering costs only the transfers bound for it (issue 15).

In-process: one sender, a live receiver and a peer socket that never answers. Through real
processes: a prefill worker asked to push to a SIGSTOPped decode worker, while streams go
through the P/D client (the proxy's) to a live decode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.kv.transport.arrivals import TransferResult
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.send_lane import HANDSHAKE_TIMEOUT_S, STALLED_PEER_S, SendLanes
from splitserve.kv.transport.shm import segment_path
from splitserve.kv.transport.types import ControlJob, PeerInfo, TransferError
from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import WorkerPool
from tests.conftest import free_port, running_servers, wire_request
from tests.kv.transport_peer import SHAPE, filled_pool, pattern, receiver

SRC, DST = [0, 3, 6], [5, 2, 7]
# The senders below give up a silent peer's connection set-up after this (the transport's
# default: HANDSHAKE_TIMEOUT_S, 3 s): a live peer in this process has set up its connection
# and landed its transfer within milliseconds.
HANDSHAKE_S = 1.0


@contextlib.contextmanager
def silent_peer(how: str = "stopped") -> Iterator[PeerInfo]:
    """A peer that never answers: "stopped", a bound socket whose owner never reads
    (connecting works, as with a SIGSTOPped worker), or "gone", nothing listening (as
    with a killed one)."""
    if how == "gone":
        yield PeerInfo("silent", "127.0.0.1", free_port())
        return
    context = zmq.Context()
    sink = context.socket(zmq.ROUTER)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield PeerInfo("silent", "127.0.0.1", port)
    finally:
        sink.close(0)
        context.term()


class Results:
    def __init__(self) -> None:
        self.by_id: dict[str, TransferResult] = {}
        self.arrived = threading.Condition()

    def on_done(self, result: TransferResult) -> None:
        with self.arrived:
            self.by_id[result.transfer_id] = result
            self.arrived.notify_all()

    def wait(self, transfer_id: str, timeout_s: float = 30) -> TransferResult:
        with self.arrived:
            assert self.arrived.wait_for(lambda: transfer_id in self.by_id, timeout_s)
            return self.by_id[transfer_id]


@pytest.mark.parametrize("how", ["stopped", "gone"])
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_silent_peer_delays_only_its_own_transfers(kind, how):
    # the KV timeout is long: only the stalled-peer bound may end the silent peer's transfer
    config = TransferConfig(transport=kind, timeout_s=30, handshake_timeout_s=HANDSHAKE_S)
    sender, receiver = make_transport("sender", config), make_transport("live", config)
    results = Results()
    with silent_peer(how) as silent:
        try:
            filled_pool(sender)
            sender.start()
            receiver.allocate_pool(SHAPE, torch.float32)
            live = receiver.start()
            for transfer_id in ("before", "after"):
                receiver.expect(transfer_id, DST, results.on_done)
            # the silent peer's jobs go first; with one sender thread they blocked the rest
            for layer in range(SHAPE[0]):
                sender.push_layer(silent, "doomed", layer, SRC, DST)
                sender.push_layer(live, "before", layer, SRC, DST)
            landed = results.wait("before")
            assert landed.ok, landed
            assert sender.take_send_error("doomed") is None  # still waiting for its handshake
            assert torch.equal(receiver.pool[:, :, DST], pattern(SRC))

            assert sender.flush()  # bounded by the stalled-peer bound, not the KV timeout
            error = sender.take_send_error("doomed")
            assert error is not None and "no progress" in error and "silent" in error
            assert f"connection set-up for {HANDSHAKE_S:.1f}s" in error  # the configured bound
            # during the cool-down the silent peer's jobs fail at once, the live peer's go on
            with pytest.raises(TransferError, match="not retried"):
                sender.push_layer(silent, "doomed-again", 0, SRC, DST)
            sender.send_failure(silent, "doomed-again", "never sent")  # never raises
            for layer in range(SHAPE[0]):
                sender.push_layer(live, "after", layer, SRC, DST)
            assert results.wait("after").ok
        finally:
            sender.close()
            receiver.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_pull_from_a_silent_source_fails_alone(kind):
    config = TransferConfig(transport=kind, timeout_s=30, handshake_timeout_s=HANDSHAKE_S)
    source, puller = make_transport("source", config), make_transport("puller", config)
    results = Results()
    with silent_peer() as silent:
        try:
            filled_pool(source)
            live = source.start()
            puller.allocate_pool(SHAPE, torch.float32)
            puller.start()
            puller.expect("doomed", [1, 4], results.on_done)
            puller.expect("fine", DST, results.on_done)
            puller.pull(silent, "doomed", [0, 1], [1, 4])
            puller.pull(live, "fine", SRC, DST)
            fine = results.wait("fine")
            assert fine.ok, fine
            assert torch.equal(puller.pool[:, :, DST], pattern(SRC))
            doomed = results.wait("doomed")
            assert not doomed.ok and "no progress" in doomed.error
            assert list(results.by_id) == ["fine", "doomed"]  # the live pull did not wait
            # while the silent peer cools down, a pull from it fails at once, on the caller
            puller.expect("doomed-again", [1], results.on_done)
            puller.pull(silent, "doomed-again", [0], [1])
            assert not results.wait("doomed-again", 0).ok
        finally:
            puller.close()
            source.close()


def mappings_of(path: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(line.rstrip().endswith(f"{path} (deleted)") for line in maps)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_an_idle_lane_ends_and_a_fresh_one_takes_the_next_job(kind):
    """A lane ends after idling, and with it the sender's mapping of the peer's pool (a
    dead peer's memory is not kept alive by its peers); the next job gets a fresh lane."""
    config = TransferConfig(transport=kind, timeout_s=10)
    sender, receiver = make_transport("sender", config), make_transport("live", config)
    context = zmq.Context()
    results = Results()
    try:
        filled_pool(sender)
        receiver.allocate_pool(SHAPE, torch.float32)
        live = receiver.start()
        segment = segment_path(os.getpid(), "live")
        gc.collect()  # an earlier test's pool of the same name may still be mapped until collected
        mapped_by_receiver = mappings_of(segment)
        lanes = SendLanes(sender, context, {zmq.LINGER: 0}, 8, config.timeout_s)
        assert (lanes.stalled_peer_s, lanes.handshake_timeout_s) == (STALLED_PEER_S, HANDSHAKE_TIMEOUT_S)
        lanes.idle_lane_s = 0.2
        lane_name = f"kv-lane-{live.host}:{live.port}"
        for transfer_id in ("first", "second"):
            receiver.expect(transfer_id, DST, results.on_done)
            lanes.put(live, ControlJob(live, b"FAIL", {"transfer_id": transfer_id, "error": "told"}))
            assert "told" in results.wait(transfer_id).error
            if kind == "shm":
                assert mappings_of(segment) == mapped_by_receiver + 1
            deadline = time.monotonic() + 30
            while any(thread.name == lane_name for thread in threading.enumerate()):
                assert time.monotonic() < deadline, "the idle lane's thread did not end"
                time.sleep(0.05)
            if kind == "shm":
                assert mappings_of(segment) == mapped_by_receiver
        assert lanes.close(5)
    finally:
        context.term()
        sender.close()
        receiver.close()


def test_a_lane_ends_at_once_when_the_peer_whose_pool_it_maps_dies():
    """A killed peer's pool lives on in the memory of every sender that maps it: the lane
    that maps it ends within a second of the peer's death (not after idling, 120 s), and
    with it the mapping. (`up` restarts a killed decode worker as a new engine: each of
    its deaths left prefill ~8 MiB more resident with the tiny model's pool, GBs with a
    real one.)"""
    context = multiprocessing.get_context("spawn")
    to_parent, from_parent = context.Queue(), context.Queue()
    peer_process = context.Process(target=receiver, args=("shm", 10, 30, DST, to_parent, from_parent))
    peer_process.start()
    sender = make_transport("sender", TransferConfig(transport="shm", timeout_s=10))
    try:
        peer = PeerInfo(*to_parent.get(timeout=60))
        filled_pool(sender)
        sender.start()
        for layer in range(SHAPE[0]):
            sender.push_layer(peer, "t1", layer, SRC, DST)
        assert sender.flush(10)
        result, _ = to_parent.get(timeout=30)
        assert result["ok"], result
        segment = segment_path(peer_process.pid, "recv")
        assert mappings_of(segment) == 1  # the lane's, idle now
        peer_process.kill()
        peer_process.join(30)
        deadline = time.monotonic() + 10
        while mappings_of(segment):
            assert time.monotonic() < deadline, "the dead peer's pool is still mapped"
            time.sleep(0.05)
    finally:
        peer_process.kill()
        peer_process.join(30)
        sender.close()


# ---- real processes -------------------------------------------------------------------

BLOCK_SIZE = 16


async def stream_tokens(client: PDEngineClient, prompt: list[int]) -> tuple[list[int], float]:
    """The streamed token IDs and the longest wait for a chunk, from the request on."""
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0}}
    tokens: list[int] = []
    last = time.monotonic()
    worst_gap = 0.0
    async for chunk in client.generate(wire_request(body)):
        now = time.monotonic()
        worst_gap, last = max(worst_gap, now - last), now
        tokens += chunk["choices"][0].get("token_ids") or []
    return tokens, worst_gap


async def stream_all(prefill: str, decode: str, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
    client = PDEngineClient(
        WorkerPool([prefill], [decode]), PDPolicy(min_prefill_tokens=16, decision="threshold")
    )
    try:
        return list(await asyncio.gather(*(stream_tokens(client, prompt) for prompt in prompts)))
    finally:
        await client.close()


def test_a_stopped_decode_peer_freezes_no_stream(tiny_model):
    """kv_transfer_params naming a SIGSTOPped decode worker used to freeze every stream of
    the prefill worker for the KV timeout (29 s); now that request fails alone."""
    prefill_port, live_port, stopped_port = free_port(), free_port(), free_port()
    engine = ["engine", tiny_model, "--num-blocks", "512", "--block-size", str(BLOCK_SIZE)]
    engine += ["--kv-transport", "shm", "--kv-timeout", "30"]
    prompts = [list(range(5 + i, 70 + 3 * i)) for i in range(4)]
    doomed_prompt = list(range(7, 64))
    blocks = -(-(len(doomed_prompt) - 1) // BLOCK_SIZE)
    servers = [
        ([*engine, "--role", role, "--port", str(port)], port)
        for role, port in (("prefill", prefill_port), ("decode", live_port), ("decode", stopped_port))
    ]
    with running_servers(servers) as (prefill, live, stopped):
        undisturbed = asyncio.run(stream_all(prefill, live, prompts))
        stopped_info = httpx.get(f"{stopped}/inference/v1/kv/info").json()
        doomed_params = {
            "do_remote_decode": True,
            "transfer_mode": "push",
            "remote_engine_id": stopped_info["remote_engine_id"],
            "remote_host": stopped_info["remote_host"],
            "remote_port": stopped_info["remote_port"],
            "remote_block_ids": list(range(1, blocks + 1)),
        }
        os.kill(stopped_info["pid"], signal.SIGSTOP)
        try:

            async def disturbed() -> tuple[dict, list[tuple[list[int], float]]]:
                async with httpx.AsyncClient(timeout=120) as http:
                    doomed = asyncio.ensure_future(
                        http.post(
                            f"{prefill}/inference/v1/generate",
                            json={
                                "token_ids": doomed_prompt,
                                "sampling_params": {"max_tokens": 1, "temperature": 0},
                                "kv_transfer_params": doomed_params,
                            },
                        )
                    )
                    streams = await stream_all(prefill, live, prompts)
                    return (await doomed).json(), streams

            doomed_answer, streams = asyncio.run(disturbed())
        finally:
            os.kill(stopped_info["pid"], signal.SIGKILL)
        assert [tokens for tokens, _ in streams] == [tokens for tokens, _ in undisturbed]
        # coarse: it tests freezing (the KV timeout is 30 s), not speed
        assert max(gap for _, gap in streams) < 10
        error = doomed_answer["kv_transfer_params"]["kv_transfer_error"]
        assert "no progress" in error, doomed_answer
        assert httpx.get(f"{prefill}/health").status_code == 200
