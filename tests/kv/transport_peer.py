"""Child-process halves of the transport tests (run under multiprocessing spawn)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from splitserve.config import TransferConfig
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.nixl_package import nixl_present

# the test extra installs NIXL (splitserve[nixl]); without it the nixl cases are skipped
NEEDS_NIXL = pytest.mark.skipif(
    not nixl_present(), reason="NIXL is not installed: pip install 'splitserve[nixl]'"
)
TRANSPORTS = ["shm", "tcp", pytest.param("nixl", marks=NEEDS_NIXL)]

SHAPE = (3, 2, 8, 4, 2, 5)  # layers, k/v, blocks, block size, kv heads, head dim


def pattern(block_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values per (layer, k/v, source block): what a pushed block must hold."""
    layers, kv, _, *rest = SHAPE
    values = 1000 * torch.arange(layers, dtype=torch.float32).view(layers, 1, 1)
    values = values + 100 * torch.arange(kv, dtype=torch.float32).view(1, kv, 1)
    values = values + torch.tensor(block_ids, dtype=torch.float32).view(1, 1, -1)
    return (
        values.view(layers, kv, len(block_ids), 1, 1, 1).expand(layers, kv, len(block_ids), *rest).to(dtype)
    )


def filled_pool(transport, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    pool = transport.allocate_pool(SHAPE, dtype)
    pool[:, :, :] = pattern(list(range(SHAPE[2])), dtype)
    return pool


def receiver(kind: str, timeout_s: float, ttl_s: float, dst: list[int], to_parent, from_parent) -> None:
    """Expect `dst` blocks, report the peer address, then the result and the pool's content."""
    config = TransferConfig(transport=kind, timeout_s=timeout_s, reservation_ttl_s=ttl_s)
    transport = make_transport("recv", config)
    transport.allocate_pool(SHAPE, torch.float32)
    done = threading.Event()
    results = []

    def on_done(result) -> None:
        results.append(result)
        done.set()

    transport.expect("t1", dst, on_done)
    to_parent.put(tuple(transport.start()))
    done.wait(60)
    result = results[0] if results else None
    received = transport.pool[:, :, dst].clone() if transport.pool is not None else None
    to_parent.put((result and result._asdict(), received))
    from_parent.get(timeout=60)
    transport.close()


def dying_sender(kind: str, peer: tuple, src: list[int], dst: list[int], layers_before_death: int) -> None:
    """Push some layers, then die without a word (as a killed prefill worker would)."""
    from splitserve.kv.transport.types import PeerInfo

    transport = make_transport("dying", TransferConfig(transport=kind, timeout_s=5))
    filled_pool(transport)
    transport.start()
    for layer in range(layers_before_death):
        transport.push_layer(PeerInfo(*peer), "t1", layer, src, dst)
    transport.flush(10)  # handed to ZeroMQ, whose I/O thread writes it to the wire...
    time.sleep(0.5)  # ...which under load can take longer than reaching the _exit below
    os._exit(0)


def kv_hashes(block_ids: list[int]) -> list[str]:
    """The token hashes `pull_source` holds its blocks under (a pull must name them)."""
    return [f"kv-of-block-{block}" for block in block_ids]


def pull_source(kind: str, to_parent, from_parent) -> None:
    """Hold a filled pool and serve pulls, each hold once; report released transfer IDs."""
    transport = make_transport("source", TransferConfig(transport=kind, timeout_s=5))
    filled_pool(transport)
    released = []
    held = {0, 3, 6}  # the blocks lent under every transfer but "gone", until it is released

    def is_held(transfer_id: str, blocks: list[int], hashes: list[str]) -> bool:
        usable = transfer_id != "gone" and transfer_id not in released
        return usable and held.issuperset(blocks) and hashes == kv_hashes(blocks)

    transport.is_held = is_held
    transport.on_release = released.append
    to_parent.put(tuple(transport.start()))
    while from_parent.get(timeout=60) is not None:
        to_parent.put(list(released))
    transport.close()


def churn(kind: str, rounds: int) -> None:
    """Start and close a sender and a receiver `rounds` times, each closed with transfers in
    flight (to the receiver and to a peer that never answers); print this process's pid."""
    import zmq

    from splitserve.kv.transport.types import PeerInfo

    context = zmq.Context()
    sink = context.socket(zmq.ROUTER)  # bound, never read: a stalled peer
    silent = PeerInfo("silent", "127.0.0.1", sink.bind_to_random_port("tcp://127.0.0.1"))
    config = TransferConfig(transport=kind, timeout_s=5)
    src, dst = [0, 3, 6], [5, 2, 7]
    for round_ in range(rounds):
        receiver_ = make_transport(f"recv{round_}", config)
        receiver_.allocate_pool(SHAPE, torch.float32)
        live = receiver_.start()
        receiver_.expect("t", dst, lambda result: None)
        sender = make_transport(f"send{round_}", config)
        filled_pool(sender)
        sender.start()
        for layer in range(SHAPE[0]):
            sender.push_layer(live, "t", layer, src, dst)
            sender.push_layer(silent, "d", layer, src, dst)
        sender.pull(live, "p", src, dst)
        # no flush: both close while jobs are queued, sent or half-received
        first, second = (sender, receiver_) if round_ % 2 else (receiver_, sender)
        first.close()
        second.close()
    sink.close(0)
    context.term()
    print(os.getpid(), flush=True)
