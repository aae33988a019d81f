"""`kv_transfer_params`: the one typed form of the P/D handshake, and its one wire form.

On the wire it is a JSON object with vLLM's key names (`do_remote_prefill`,
`do_remote_decode`, `remote_engine_id`, `remote_host`, `remote_port`,
`remote_request_id`, `remote_block_ids`, `remote_num_tokens`, plus splitserve's
`transfer_mode`, `remote_first_block`, `prompt_token_ids`, `prefill_done_at`,
`push_target_pending` (push: prefill starts now, its target is posted later), and for
bidirectional transfer `prefix_lend_id`, `prefix_block_ids`, `prefix_block_hashes`: the
leading blocks decode holds of this prompt, by chained block hash, that prefill may pull);
a finished request reports `kv_bytes`, `state_bytes` (a hybrid model's Mamba state,
apart from the KV), `send_s`, `kv_transfer_error`, `handoff`,
`prompt_sources` and, through the proxy, `prefill`. A request carries it parsed (the
typed generate request, protocol/generate_request.py) into the engine's `Request`; every
tier reads and writes it only through `KVTransferParams`.

Reading is lenient by design: a field that cannot describe a transfer leaves the flags
readable and makes `remote_address()`/`block_ids()` raise `KVParamsError`, so the engine
computes the prompt itself instead of failing the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from splitserve.protocol.errors import APIError, InvalidRequestError

TransferMode = Literal["push", "pull"]
KV_TRANSFER_PARAMS = "kv_transfer_params"  # the key, in a generate request and in its final chunk


class KVParamsError(ValueError):
    """kv_transfer_params that cannot describe a transfer."""


class RemoteAddress(NamedTuple):
    """Where a worker's KV transport listens."""

    engine_id: str
    host: str
    port: int


def _int_list(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_prefill: bool = False  # decode: the prompt's KV comes from a prefill worker
    do_remote_decode: bool = False  # prefill: ship the prompt's KV to a decode worker
    transfer_mode: TransferMode | None = None  # None: the engine's configured mode
    remote_request_id: str | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_first_block: int | None = None  # push: the first block decode reserved (None: 0)
    remote_num_tokens: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # pull: what prefill computed
    prefill_done_at: float | None = None  # wall clock when prefill's last layer was computed
    # bidirectional (push): decode's leading blocks of this prompt, leased under
    # prefix_lend_id at decode's remote_* address, with the hex block hashes decode matched
    prefix_lend_id: str | None = None
    prefix_block_ids: tuple[int, ...] | None = None
    prefix_block_hashes: tuple[str, ...] | None = None
    # push, prefill: start computing now; where to push comes later (POST
    # /inference/v1/kv/push_target), so decode's reservation is not a serial round trip
    push_target_pending: bool = False
    # what a finished request reports
    kv_bytes: int | None = None
    state_bytes: int | None = None  # a hybrid model's Mamba state, handed over whole
    send_s: float | None = None
    kv_transfer_error: str | None = None
    handoff: dict[str, Any] | None = None  # decode: where the TTFT went
    prefill: dict[str, Any] | None = None  # through the proxy: what prefill reported
    prompt_sources: dict[str, Any] | None = None  # prefill: reused, pulled, recomputed, where reuse stopped
    # why the transfer fields cannot describe a transfer (read leniently), if they cannot
    invalid: str | None = None

    @classmethod
    def from_wire(cls, data: Any) -> KVTransferParams:
        if not isinstance(data, dict):
            return cls()
        problems: list[str] = []

        def take(name: str, parsed: Any) -> Any:
            if data.get(name) is not None and parsed is None:
                problems.append(f"kv_transfer_params.{name} is not valid: {data[name]!r}")
            return parsed

        port = data.get("remote_port")
        mode = data.get("transfer_mode")
        return cls(
            do_remote_prefill=data.get("do_remote_prefill") is True,
            do_remote_decode=data.get("do_remote_decode") is True,
            transfer_mode=take("transfer_mode", mode if mode in ("push", "pull") else None),
            remote_request_id=take("remote_request_id", _text(data.get("remote_request_id"))),
            remote_engine_id=take("remote_engine_id", _text(data.get("remote_engine_id"))),
            remote_host=take("remote_host", _text(data.get("remote_host"))),
            remote_port=take("remote_port", port if type(port) is int and 0 < port < 65536 else None),
            remote_block_ids=take("remote_block_ids", _int_list(data.get("remote_block_ids"))),
            remote_first_block=take("remote_first_block", _count(data.get("remote_first_block"))),
            remote_num_tokens=take("remote_num_tokens", _count(data.get("remote_num_tokens"))),
            prompt_token_ids=take("prompt_token_ids", _int_list(data.get("prompt_token_ids"))),
            prefill_done_at=take("prefill_done_at", _number(data.get("prefill_done_at"))),
            prefix_lend_id=take("prefix_lend_id", _text(data.get("prefix_lend_id"))),
            prefix_block_ids=take("prefix_block_ids", _int_list(data.get("prefix_block_ids"))),
            prefix_block_hashes=take("prefix_block_hashes", _hex_list(data.get("prefix_block_hashes"))),
            push_target_pending=data.get("push_target_pending") is True,
            kv_bytes=_count(data.get("kv_bytes")),
            state_bytes=_count(data.get("state_bytes")),
            send_s=_number(data.get("send_s")),
            kv_transfer_error=_text(data.get("kv_transfer_error")),
            handoff=data.get("handoff") if isinstance(data.get("handoff"), dict) else None,
            prefill=data.get("prefill") if isinstance(data.get("prefill"), dict) else None,
            prompt_sources=_dict(data.get("prompt_sources")),
            invalid="; ".join(problems) or None,
        )

    def to_wire(self) -> dict[str, Any]:
        """The JSON object: set fields only (flags when true), lists for tuples."""
        wire: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "invalid" or value is None or value is False:
                continue
            wire[field.name] = list(value) if isinstance(value, tuple) else value
        return wire

    def mode(self, default: TransferMode) -> TransferMode:
        return self.transfer_mode or default

    def remote_address(self) -> RemoteAddress:
        if self.remote_engine_id is None or self.remote_host is None or self.remote_port is None:
            raise KVParamsError(self.invalid or "kv_transfer_params lack a remote engine address")
        return RemoteAddress(self.remote_engine_id, self.remote_host, self.remote_port)

    def block_ids(self) -> tuple[int, ...]:
        if self.remote_block_ids is None:
            raise KVParamsError(self.invalid or "kv_transfer_params.remote_block_ids is missing")
        return self.remote_block_ids

    def prefix_offer(self) -> tuple[str, tuple[int, ...], tuple[str, ...]] | None:
        """(lend ID, decode's block IDs, their hex hashes) of a usable prefix offer, else None."""
        lend, blocks, hashes = self.prefix_lend_id, self.prefix_block_ids, self.prefix_block_hashes
        if lend is None or not blocks or hashes is None or len(blocks) != len(hashes):
            return None
        return lend, blocks, hashes

    def with_address(self, address: RemoteAddress) -> KVTransferParams:
        return dataclasses.replace(
            self, remote_engine_id=address.engine_id, remote_host=address.host, remote_port=address.port
        )


_TRANSFER_FIELDS = (
    "transfer_mode",
    "remote_request_id",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_first_block",
    "remote_num_tokens",
    "prompt_token_ids",
    "prefill_done_at",
    "prefix_lend_id",
    "prefix_block_ids",
    "prefix_block_hashes",
)


def check_kv_transfer_params(data: dict[str, Any]) -> KVTransferParams:
    """Strict reading for a request's edge: the first field that cannot describe a
    transfer is a 400 naming it, so it fails that request alone, before the engine loop."""
    params = KVTransferParams.from_wire(data)
    for flag in ("do_remote_prefill", "do_remote_decode", "push_target_pending"):
        param = f"kv_transfer_params.{flag}"
        if data.get(flag) is not None and not isinstance(data[flag], bool):
            raise InvalidRequestError(f"{param} must be a boolean", param)
    for name in _TRANSFER_FIELDS:
        param = f"kv_transfer_params.{name}"
        if data.get(name) is not None and getattr(params, name) is None:
            raise InvalidRequestError(f"{param} is not valid: {str(data[name])[:100]}", param)
    return params


def parse_kv_transfer_params(body: dict[str, Any]) -> KVTransferParams | None:
    """A request body's kv_transfer_params, read strictly (`check_kv_transfer_params`):
    None when absent, a 400 when not an object."""
    raw = body.get(KV_TRANSFER_PARAMS)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise APIError(400, f"{KV_TRANSFER_PARAMS} must be an object", param=KV_TRANSFER_PARAMS)
    return check_kv_transfer_params(raw)


def chunk_kv_transfer_params(chunk: dict[str, Any]) -> KVTransferParams:
    """What an engine's (final) chunk reports in its kv_transfer_params, read leniently."""
    return KVTransferParams.from_wire(chunk.get(KV_TRANSFER_PARAMS))


def with_kv_transfer_params(chunk: dict[str, Any], params: KVTransferParams) -> dict[str, Any]:
    """The chunk reporting `params` as its kv_transfer_params."""
    return {**chunk, KV_TRANSFER_PARAMS: params.to_wire()}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _hex_list(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, (list, tuple)) and all(_is_hex(v) for v in value):
        return tuple(value)
    return None


def _is_hex(value: Any) -> bool:
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None
