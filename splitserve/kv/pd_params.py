"""Reading the transfer fields of kv_transfer_params (DESIGN.md "Wire APIs")."""

from __future__ import annotations

from splitserve.kv.transport import PeerInfo


class KVParamsError(ValueError):
    """kv_transfer_params that cannot describe a transfer."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def peer_from_params(params: dict) -> PeerInfo:
    try:
        return PeerInfo(
            str(params["remote_engine_id"]), str(params["remote_host"]), int(params["remote_port"])
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise KVParamsError(f"kv_transfer_params lack a valid remote address: {exc}") from exc


def block_list(params: dict, key: str) -> list[int]:
    value = params.get(key)
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        raise KVParamsError(f"kv_transfer_params.{key} must be a list of block IDs")
    return value
