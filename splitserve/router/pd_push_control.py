"""The control calls of a push handoff, between the proxy and the engines' KV endpoints
(`engine/api/kv_routes.py`): decode's reservation, the push target forwarded to a prefill
request already running, and the word to decode that its KV will not come."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import httpx

from splitserve.protocol.errors import APIError
from splitserve.protocol.kv_transfer import KVParamsError, KVTransferParams, with_kv_transfer_params
from splitserve.router.metrics import ProxyMetrics
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import Worker

logger = logging.getLogger(__name__)


class PushControl:
    def __init__(self, http: httpx.AsyncClient, policy: PDPolicy, metrics: ProxyMetrics) -> None:
        self.http = http
        self.policy = policy
        self.metrics = metrics

    async def reserve(
        self, decode: Worker, request_id: str, first_task: asyncio.Future
    ) -> KVTransferParams | None:
        """Where prefill must push; None when nothing is to be pushed (decode holds the
        whole prompt, or reserved nothing). If the decode request ends first, its error
        surfaces."""
        reserve_task = asyncio.ensure_future(
            self.http.post(
                f"{decode.url}/inference/v1/kv/reserve",
                json={"request_id": request_id, "timeout_s": self.policy.reserve_timeout_s},
                timeout=self.policy.reserve_timeout_s + 10,
            )
        )
        try:
            await asyncio.wait({reserve_task, first_task}, return_when=asyncio.FIRST_COMPLETED)
            if not reserve_task.done():
                first_task.result()  # raises the decode request's error, if it had one
                return None  # decode answered without waiting for KV
            try:
                response = reserve_task.result()
            except httpx.HTTPError as exc:
                raise APIError(503, f"decode worker {decode.url} is unreachable: {exc}") from exc
            if response.status_code != 200:
                self.metrics.fallbacks.labels("no_reservation").inc()
                logger.warning("no reservation from %s: %s", decode.url, response.text[:200])
                return None
            reservation = KVTransferParams.from_wire(response.json())
            if not reservation.remote_block_ids:
                return None  # decode's prefix cache already holds the prompt
            try:
                reservation.remote_address()
            except KVParamsError as exc:
                self.metrics.fallbacks.labels("no_reservation").inc()
                logger.warning("unusable reservation from %s: %s", decode.url, exc)
                return None
            return reservation
        finally:
            if not reserve_task.done():
                reserve_task.cancel()
                await asyncio.gather(reserve_task, return_exceptions=True)

    def push_params(self, reservation: KVTransferParams) -> KVTransferParams:
        """Where prefill pushes, from decode's reservation (with its prefix offer when
        bidirectional)."""
        kv = KVTransferParams(
            do_remote_decode=True,
            transfer_mode="push",
            remote_request_id=reservation.remote_request_id,
            remote_block_ids=reservation.remote_block_ids,
            remote_first_block=reservation.remote_first_block,
        ).with_address(reservation.remote_address())
        offer = reservation.prefix_offer() if self.policy.bidirectional else None
        if offer is not None:  # decode's held prefix, by block hash: prefill pulls it
            kv = dataclasses.replace(
                kv, prefix_lend_id=offer[0], prefix_block_ids=offer[1], prefix_block_hashes=offer[2]
            )
        return kv

    async def send_target(
        self,
        decode: Worker,
        prefill: Worker,
        request_id: str,
        target: KVTransferParams | None,
        prefill_task: asyncio.Future,
        report: dict,
    ) -> None:
        """Tell the already running prefill request where to push (`target`), or that
        nothing is to be pushed (None: decode holds the prompt, or reserved nothing): then
        it is stopped, as if it had never been sent. A target prefill cannot take makes
        decode recompute, as a failed prefill does."""
        message: dict = {"request_id": f"{request_id}-prefill"}
        if target is not None:
            message = with_kv_transfer_params(message, target)
        url = f"{prefill.url}/inference/v1/kv/push_target"
        failure: str | None = None
        try:
            response = await self.http.post(url, json=message, timeout=self.policy.reserve_timeout_s + 10)
        except httpx.HTTPError as exc:
            failure = f"prefill worker {prefill.url} is unreachable: {exc}"
        else:
            if response.status_code != 200:
                failure = f"prefill on {prefill.url} refused the push target: {response.text[:200]}"
            else:
                sent = KVTransferParams.from_wire(response.json())  # a parked prefill's push
                reported = ("kv_bytes", "state_bytes", "send_s")
                report.update({k: v for k, v in sent.to_wire().items() if k in reported})
                failure = sent.kv_transfer_error
        if target is None or failure is not None:
            prefill_task.cancel()
            await asyncio.gather(prefill_task, return_exceptions=True)
        if target is not None and failure is not None:
            await self.prefill_failed(decode, request_id, failure)

    async def prefill_failed(self, decode: Worker, request_id: str, error: str) -> None:
        """Decode stops waiting for the request's KV and recomputes (or fails, by policy)."""
        self.metrics.prefill_failures.inc()
        self.metrics.fallbacks.labels("prefill_failed").inc()
        logger.warning("%s; decode %s recomputes", error, decode.url)
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(
                f"{decode.url}/inference/v1/kv/transfer_failed",
                json={"request_id": request_id, "error": error},
                timeout=10,
            )
