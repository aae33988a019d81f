"""What the prefill side and the decode side of the P/D connector share: the transport and
its KV pool, the handoff metrics, the table of loads in flight, and how an engine is woken
or told to end a request when a transfer ends (pd_connector.py says how the two meet)."""

from __future__ import annotations

import logging
import uuid
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from splitserve.config import EngineRole, TransferConfig
from splitserve.kv.connector.base import KVCacheAllocator, KVConnector
from splitserve.kv.connector.handoff_metrics import HandoffMetrics
from splitserve.kv.connector.load_table import Arrival, LoadTable
from splitserve.kv.transport.arrivals import TransferResult
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.factory import make_transport
from splitserve.kv.transport.types import PeerInfo, TransferError
from splitserve.protocol.kv_transfer import RemoteAddress

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class PDConnector(KVConnector):
    role: ClassVar[EngineRole]

    def __init__(
        self,
        config: TransferConfig,
        *,
        engine_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: KVTransport | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.transport = transport or make_transport(self.engine_id, config, host, port)
        self.transport.on_release = self.release_transfer
        self.transport.is_held = self.is_held
        self.metrics = HandoffMetrics(self.gauges)
        self.loads = LoadTable(self.metrics)
        self.wakeup: Callable[[], None] | None = None
        self.abort: Callable[[str], object] | None = None
        self.block_size = 0
        self.num_layers = 0
        self.state_bytes = 0  # a hybrid model's Mamba state per request (0: none travels)
        self.peer: PeerInfo | None = None

    # ---- what each side answers for the transport and /metrics ------------------------
    @abstractmethod
    def is_held(self, transfer_id: str, block_ids: list[int], block_hashes: list[str]) -> bool:
        """Whether a peer may read these blocks under `transfer_id` now."""

    @abstractmethod
    def release_transfer(self, transfer_id: str) -> None:
        """A peer finished reading what `transfer_id` lent it."""

    @abstractmethod
    def gauges(self) -> dict[str, float]:
        """The live value of each of handoff_metrics.GAUGES."""

    # ---- set-up -----------------------------------------------------------------------
    def kv_cache_allocator(self) -> KVCacheAllocator:
        def allocate(shape: tuple[int, ...], *, dtype: torch.dtype, device: object = "cpu") -> torch.Tensor:
            return self.transport.allocate_pool(tuple(shape), dtype, str(device))

        return allocate

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        if self.transport.pool is None:
            self.transport.pool = kv_cache  # an allocator of the caller's: tcp can still send from it
        elif self.transport.pool.data_ptr() != kv_cache.data_ptr():
            raise TransferError("the engine's KV cache is not the transport's pool")
        self.block_size = block_size
        self.num_layers = kv_cache.shape[0]
        self.peer = self.transport.start()

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self.wakeup = wakeup

    def register_state(self, state_bytes: int) -> None:
        # the state frame rides the control channel every transport shares (nixl's too)
        self.state_bytes = self.transport.state_bytes = state_bytes

    def set_abort(self, abort: Callable[[str], object]) -> None:
        """How to end a request whose KV failed under failure_policy "fail" (thread-safe,
        e.g. `AsyncEngine.abort`). Without it, failed loads always recompute."""
        self.abort = abort

    def kv_address(self) -> RemoteAddress:
        """This worker's KV endpoint (remote_engine_id/host/port in kv_transfer_params)."""
        assert self.peer is not None
        return RemoteAddress(self.peer.engine_id, self.peer.host, self.peer.port)

    def wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    # ---- loads ------------------------------------------------------------------------
    @abstractmethod
    def settle_arrival(self, arrival: Arrival, result: TransferResult) -> None:
        """Transport thread, before the arrival is counted and the engine woken: what this
        side holds for the transfer's request ends."""

    def report_arrival(self, side: str, result: TransferResult) -> None:
        """Transport thread: the last layer arrived, or the transfer failed."""
        may_fail = self.config.failure_policy == "fail" and self.abort is not None
        arrival = self.loads.arrived(result, may_fail)
        if arrival is None:
            return
        self.settle_arrival(arrival, result)
        request_id, load, fallback = arrival
        if not result.ok:
            logger.warning("KV transfer %s for %s failed: %s", side, request_id, result.error)
        self.metrics.count_arrival(side, result, load.num_blocks, load.transfer_s, fallback)
        if fallback == "fail" and self.abort is not None:
            self.abort(request_id)
        self.wake()

    def get_finished_loading(self) -> set[str]:
        return self.loads.take_loaded()

    def get_failed_loading(self) -> set[str]:
        return self.loads.take_failed()

    def get_finished_sending(self) -> set[str]:
        return self.loads.take_freeable()

    def fail_transfer(self, request_id: str, error: str) -> bool:
        """Give up waiting for a request's KV now (the proxy saw its prefill fail)."""
        transfer_id = self.loads.in_flight_transfer(request_id)
        if transfer_id is None:
            return False
        self.transport.fail(transfer_id, error)
        return True

    def shutdown(self) -> None:
        self.transport.close()
