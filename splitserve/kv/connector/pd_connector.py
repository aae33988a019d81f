"""The P/D connector: the engine's KV seam for prefill and decode workers, one class per side
(prefill_side.py, decode_side.py) over what both share (pd_base.py, load_table.py).

Push (default): the decode request arrives first with `do_remote_prefill`; after its own
prefix-cache match it reserves blocks for the missing positions and parks in
WAITING_FOR_REMOTE_KVS. The proxy reads that reservation and sends the prefill request
with `do_remote_decode` and the decode block IDs; the prefill worker ships each layer's
finished blocks from `save_kv_layer`, while the next layer computes. Decode counts the
arrivals and wakes its engine on the last one.

Pull (vLLM NIXL's behaviour, kept for comparison): the prefill worker finishes, holds its
blocks and returns where they are; decode reads them after it is scheduled, then tells
prefill to release them (or the hold expires after the TTL).

Concurrent reservation (push): the proxy may send the prefill request at once with
`push_target_pending`; prefill computes while decode reserves, and the proxy forwards the
reservation (`POST /inference/v1/kv/push_target`); the layers computed by then are queued
at once (`kv/connector/layer_push.py`).

Bidirectional (push): decode's reservation also offers the leading blocks it already
holds of the prompt, by chained block hash (`kv/connector/prefix_lend.py`); prefill pulls the run
whose hashes equal its own request's before computing the rest.

A transfer that fails or times out makes decode recompute the prompt itself; a prefix
pull that fails makes prefill compute those blocks itself.
"""

from __future__ import annotations

from splitserve.config import EngineRole, TransferConfig
from splitserve.kv.connector.decode_side import DecodeConnector
from splitserve.kv.connector.prefill_side import PrefillConnector
from splitserve.kv.transport.base import KVTransport


def make_pd_connector(
    role: EngineRole,
    config: TransferConfig,
    *,
    engine_id: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    transport: KVTransport | None = None,
) -> PrefillConnector | DecodeConnector:
    """The connector of a prefill or a decode worker."""
    if role == "prefill":
        return PrefillConnector(config, engine_id=engine_id, host=host, port=port, transport=transport)
    if role == "decode":
        return DecodeConnector(config, engine_id=engine_id, host=host, port=port, transport=transport)
    raise ValueError(f"a P/D connector is for a prefill or decode worker, not {role!r}")
