"""The nixl KV transport's bounds (kv/transport/nixl.py): a peer writes only the blocks its
transfer was granted, with the deployment's token or not at all; without NIXL installed,
`--kv-transport nixl` stops with a clear message."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from splitserve.config import TransferConfig
from splitserve.kv.transport.arrivals import TransferResult
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.nixl import NixlTransport
from splitserve.kv.transport.types import PeerInfo, PushJob
from tests.conftest import free_port
from tests.kv.transport_peer import NEEDS_NIXL, SHAPE, filled_pool, kv_hashes, pattern, receiver

SRC, DST = [0, 3, 6], [5, 2, 7]
OUTSIDE = [1, 4]  # blocks of the receiver's pool that no transfer was granted


class ForgedPeer(NixlTransport):
    """An engine of the deployment (it holds the token) running code that skips the sender's
    grant check: it reaches the receiver's pool with one-sided WRITEs all the same."""

    def check_grant(self, grant: dict[int, str | None], job: PushJob) -> None:
        return None


class Outcomes:
    def __init__(self) -> None:
        self.by_id: dict[str, TransferResult] = {}
        self.changed = threading.Condition()

    def on_done(self, result: TransferResult) -> None:
        with self.changed:
            self.by_id[result.transfer_id] = result
            self.changed.notify_all()

    def wait(self, transfer_id: str) -> TransferResult:
        with self.changed:
            assert self.changed.wait_for(lambda: transfer_id in self.by_id, 30)
            return self.by_id[transfer_id]


def push_all_layers(sender, peer, transfer_id: str, dst: list[int], hashes: list[str]) -> str | None:
    for layer in range(SHAPE[0]):
        sender.push_layer(peer, transfer_id, layer, SRC, dst, None, hashes)
    assert sender.flush(10)
    return sender.take_send_error(transfer_id)


@NEEDS_NIXL
def test_a_peer_writes_only_inside_its_grant_and_only_with_the_token(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "the-deployment-token")
    config = TransferConfig(transport="nixl", timeout_s=1.0)
    decode, prefill = make_transport("decode-0", config), make_transport("prefill-0", config)
    forged = ForgedPeer("prefill-forged", config)
    outcomes = Outcomes()
    try:
        pool = decode.allocate_pool(SHAPE, torch.float32)
        peer = decode.start()
        for sender in (prefill, forged):
            filled_pool(sender)
            sender.start()
        decode.expect("granted", DST, outcomes.on_done, block_hashes=kv_hashes(DST))
        # the sender asks for the grant over the control channel and writes nothing outside it
        error = push_all_layers(prefill, peer, "granted", [5, 2, 1], kv_hashes([5, 2, 1]))
        assert error and "refused a NIXL WRITE to [1]" in error
        error = push_all_layers(prefill, peer, "granted", DST, ["kv-of-other-tokens"] * 3)
        assert error and "other tokens" in error
        error = push_all_layers(prefill, peer, "never-granted", DST, kv_hashes(DST))
        assert error and "expects no transfer never-granted" in error
        assert not pool.any() and "granted" not in outcomes.by_id

        # a stranger (another deployment's token) is not answered: no agent metadata, no WRITE
        monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "another-deployment")
        stranger = make_transport("prefill-stranger", config)
        try:
            filled_pool(stranger)
            stranger.start()
            error = push_all_layers(stranger, peer, "granted", DST, kv_hashes(DST)) or ""
            assert "did not answer" in error or "no progress on connection set-up" in error, error
        finally:
            stranger.close()
        assert not pool.any()

        # the forged peer's WRITE lands (one-sided), but its notification names blocks
        # outside the grant: the transfer fails (decode recomputes it) and is never used
        assert push_all_layers(forged, peer, "granted", [5, 2, 4], kv_hashes([5, 2, 4])) is None
        failed = outcomes.wait("granted")
        assert not failed.ok and "outside the transfer's grant" in failed.error
        assert decode.notifications_dropped >= 1

        # the deployment's own sender, in its grant: the KV lands and the transfer completes
        decode.expect("fresh", DST, outcomes.on_done, block_hashes=kv_hashes(DST))
        assert push_all_layers(prefill, peer, "fresh", DST, kv_hashes(DST)) is None
        done = outcomes.wait("fresh")
        assert done.ok, done
        assert torch.equal(pool[:, :, DST], pattern(SRC))
        assert not pool[:, :, OUTSIDE[0]].any()  # no WRITE of the honest sender's went there
    finally:
        for transport in (forged, prefill, decode):
            transport.close()


@NEEDS_NIXL
def test_a_write_to_a_killed_receiver_fails_at_once():
    """Decode killed mid-transfer: the next layer's WRITE fails at once (NIXL sees the
    peer's agent disconnected), never waits for the KV timeout; prefill reports it."""
    context = multiprocessing.get_context("spawn")
    to_parent, from_parent = context.Queue(), context.Queue()
    decode = context.Process(target=receiver, args=("nixl", 30, 60, DST, to_parent, from_parent))
    decode.start()
    prefill = make_transport("prefill-0", TransferConfig(transport="nixl", timeout_s=30))
    try:
        peer = PeerInfo(*to_parent.get(timeout=60))
        filled_pool(prefill)
        prefill.start()
        prefill.push_layer(peer, "t1", 0, SRC, DST)
        assert prefill.flush(10) and prefill.take_send_error("t1") is None
        os.kill(decode.pid, signal.SIGKILL)
        decode.join(30)
        started = time.monotonic()
        for layer in range(1, SHAPE[0]):
            prefill.push_layer(peer, "t1", layer, SRC, DST)
        assert prefill.flush(10)
        error = prefill.take_send_error("t1")
        assert error and "failed" in error, error
        assert time.monotonic() - started < 5
    finally:
        prefill.close()
        if decode.is_alive():
            decode.kill()
    # what is left of the closed transport, collected now: the agent that wrote to the dead
    # peer must not be destroyed (UCX's assertion on its queued request aborted the process)
    del prefill
    gc.collect()


BLOCK_NIXL = (
    "import sys; sys.modules['nixl_cu12'] = sys.modules['nixl'] = None\n"
    "from splitserve.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("command", ["up", "engine"])
def test_without_nixl_the_nixl_transport_stops_with_a_clear_message(tiny_model, command):
    """NIXL made unimportable in the child (as if not installed): `up` refuses before it
    starts anything, an engine before it builds its KV pool."""
    args = [command, tiny_model, "--port", str(free_port())]
    args += ["--transport", "nixl"] if command == "up" else ["--role", "decode", "--kv-transport", "nixl"]
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_NIXL, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (1, 2), done.stderr[-2000:]
    assert "needs NIXL, which is not installed: pip install 'splitserve[nixl]'" in done.stderr
    assert "stopped" not in done.stderr and "Traceback" not in done.stderr
