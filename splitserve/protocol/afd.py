"""The messages between an attention engine and its FFN daemon (attention-FFN
disaggregation, splitserve/afd/): their JSON headers, checked on arrival.

A message is `[kind, header, data frames..., stamp]`, sealed with the deployment's frame
MAC (kv/transport/frame_mac.py, under its own label); replies are `[header, data...,
the request's stamp]`.
  HELLO   {id, shm?: ShmOffer}                 -> FfnLayout + {id, ok, session, shm: bool,
                                                  shm_error?}
  MOE     MoeLayerRequest; data: hidden [T, H], expert ids [T, k] int32, weights [T, k]
          -> {id, ok, layer, num_tokens} + data: the combined expert output [T, H]
          With `slot` set (shm, afd/shm_slots.py): no data frames either way; the tensors
          are in that slot of the segment the engine offered in its HELLO, and the daemon
          writes the output there too.
  PING    (one frame, unsealed)                -> PONG (one frame): the daemon's main loop is
          turning (`up`'s liveness check); it says nothing else and needs no token
An error answers {id, ok: false, error}; a message that fails authentication is answered
untagged {ok: false, error: "unauthorized"}.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

HELLO = b"HELLO"
MOE = b"MOE"
PING = b"PING"
PONG = b"PONG"
WIRE_DTYPES = ("float32", "bfloat16", "float16")  # hidden states and router weights
AFD_TRANSPORTS = ("shm", "tcp", "auto")  # auto: shm when the daemon is on this host
SEGMENT_PREFIX = "afd-"  # an AFD segment's name; a daemon maps nothing else
UNAUTHORIZED = "unauthorized"


class AfdProtocolError(ValueError):
    """A header that is not what the protocol says."""


def _int(header: dict, name: str, least: int) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise AfdProtocolError(f"{name} must be an integer >= {least}, not {value!r}")
    return value


@dataclass(frozen=True)
class FfnLayout:
    """What the FFN daemon holds: the attention side checks it against its own model."""

    hidden_size: int
    num_experts: int
    top_k: int
    sparse_layers: tuple[int, ...]
    dtype: str
    shared_expert: bool = False  # each sparse layer's shared expert runs on the daemon too

    def to_header(self) -> dict:
        return {**asdict(self), "sparse_layers": list(self.sparse_layers)}

    @classmethod
    def from_header(cls, header: dict) -> FfnLayout:
        layers = header.get("sparse_layers")
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise AfdProtocolError(f"sparse_layers must be a list of layer indices, not {layers!r}")
        dtype = header.get("dtype")
        if dtype not in WIRE_DTYPES:
            raise AfdProtocolError(f"dtype must be one of {WIRE_DTYPES}, not {dtype!r}")
        shared = header.get("shared_expert", False)
        if not isinstance(shared, bool):
            raise AfdProtocolError(f"shared_expert must be true or false, not {shared!r}")
        return cls(
            _int(header, "hidden_size", 1),
            _int(header, "num_experts", 1),
            _int(header, "top_k", 1),
            tuple(layers),
            str(dtype),
            shared,
        )


@dataclass(frozen=True)
class ShmOffer:
    """An attention engine's shared-memory segment, offered in its HELLO: the daemon maps
    it (only the unlinked segment `segment` of process `pid`, reached through its open
    descriptor `fd`, kv/transport/shm.py) when `node_id` is its own host's."""

    segment: str
    pid: int
    fd: int
    node_id: str | None
    slots: int
    slot_tokens: int

    def to_header(self) -> dict:
        return asdict(self)

    @classmethod
    def from_header(cls, header: object) -> ShmOffer:
        if not isinstance(header, dict):
            raise AfdProtocolError(f"shm must be an object, not {header!r}")
        segment, node_id = header.get("segment"), header.get("node_id")
        if not isinstance(segment, str) or not segment.startswith(SEGMENT_PREFIX):
            raise AfdProtocolError(f"shm segment must be named {SEGMENT_PREFIX}..., not {segment!r}")
        if node_id is not None and not isinstance(node_id, str):
            raise AfdProtocolError(f"shm node_id must be a string, not {node_id!r}")
        return cls(
            segment,
            _int(header, "pid", 1),
            _int(header, "fd", 0),
            node_id,
            _int(header, "slots", 1),
            _int(header, "slot_tokens", 1),
        )


@dataclass(frozen=True)
class MoeLayerRequest:
    """One sparse layer of one forward pass: its tokens' hidden states and routing, in
    data frames or (`slot` set) in that slot of the engine's shared-memory segment."""

    id: int
    layer: int
    num_tokens: int
    top_k: int
    dtype: str
    slot: int | None = None

    def to_header(self) -> dict:
        return asdict(self)

    @classmethod
    def from_header(cls, header: dict) -> MoeLayerRequest:
        dtype = header.get("dtype")
        if dtype not in WIRE_DTYPES:
            raise AfdProtocolError(f"dtype must be one of {WIRE_DTYPES}, not {dtype!r}")
        return cls(
            _int(header, "id", 0),
            _int(header, "layer", 0),
            _int(header, "num_tokens", 0),
            _int(header, "top_k", 1),
            str(dtype),
            None if header.get("slot") is None else _int(header, "slot", 0),
        )
