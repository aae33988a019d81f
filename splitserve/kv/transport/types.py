"""The values KV transports exchange: peer addresses, pool layouts, errors, and the send
lanes' jobs (a transport implements the data plane of PushJob and PullJob)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import torch


class PeerInfo(NamedTuple):
    """Where a transport listens; travels in kv_transfer_params as remote_engine_id/host/port."""

    engine_id: str
    host: str
    port: int


class PoolLayout(NamedTuple):
    """What a peer must know to write into (or read from) a pool; exchanged at connection set-up.
    Never a path: a shm pool is named by its owner's pid and descriptor number, and the
    peer checks that they lead to the segment the owner's engine ID names (shm.py)."""

    shape: tuple[int, ...]
    dtype: str
    shm_pid: int | None = None
    shm_fd: int | None = None
    node_id: str | None = None  # the auto transport's node: shm only with a peer on the same one

    @property
    def num_layers(self) -> int:
        return self.shape[0]


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"not an integer: {value!r}")
    return value


def layout_from_hello(reply: dict) -> PoolLayout:
    """The pool layout in a peer's HELLO answer (KeyError, TypeError, ValueError if malformed)."""
    return PoolLayout(
        tuple(int(size) for size in reply["shape"]),
        str(reply["dtype"]),
        _optional_int(reply.get("shm_pid")),
        _optional_int(reply.get("shm_fd")),
        None if reply.get("node_id") is None else str(reply["node_id"]),
    )


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete in time."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown KV dtype {name!r}")
    return dtype


# A send lane's queue items (each job goes to its peer's lane); a transport subclass
# implements the data plane of PushJob (`_send_push`) and PullJob (`_do_pull`); a StateJob
# travels as a data frame of the authenticated control channel on every transport.


class PushJob(NamedTuple):
    peer: PeerInfo
    transfer_id: str
    layer: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    ready_at: float
    block_hashes: list[str]  # the KV's chained block hashes, one per block: what it is bound to


class StateJob(NamedTuple):
    """A hybrid model's request state (every Mamba layer's conv and SSM state as of the
    prompt's last KV position), whole, after the transfer's layers on the same lane."""

    peer: PeerInfo
    transfer_id: str
    state: bytes
    state_hash: str  # the prompt's last KV hash: the tokens the state was computed over
    ready_at: float


class PullJob(NamedTuple):
    peer: PeerInfo
    transfer_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    block_hashes: list[str]  # of the puller's own prompt: the source lends only matching blocks


class ControlJob(NamedTuple):
    peer: PeerInfo
    kind: bytes
    header: dict


class Barrier(NamedTuple):
    event: threading.Event


class CallbackJob(NamedTuple):
    """Runs on the peer's lane after the jobs queued before it; dropped if the lane stalls."""

    peer: PeerInfo
    transfer_id: str
    fn: Callable[[], None]
