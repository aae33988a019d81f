"""The streaming derender state a client carries between chunks, signed so it cannot be forged.

The payload is the parsers' compact state (detokenizer window, reasoning and tool-call
state machines, counters), never the output history, so its size does not grow with the
output. It is JSON, zlib-compressed, base64url-encoded and signed with HMAC-SHA256.

Every render replica that may serve a chunk of the same stream must share the key
(`splitserve render --state-key` or SPLITSERVE_STATE_KEY): a state signed by a replica with
a different key is refused as foreign, exactly like a tampered one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import zlib
from typing import Any

from splitserve.protocol.errors import InvalidRequestError

STATE_KEY_ENV = "SPLITSERVE_STATE_KEY"
_VERSION = "s1"
# A state is a few hundred bytes; anything far larger is not one of ours.
MAX_STATE_CHARS = 64 * 1024


class StreamStateError(InvalidRequestError):
    """The stream_state is malformed, tampered with, or signed with another key (HTTP 400)."""


def resolve_state_key(explicit: str | None) -> tuple[bytes, bool]:
    """The signing key: the explicit one, else $SPLITSERVE_STATE_KEY, else a random key that
    only this process knows. Returns (key, shared): shared is False for the random fallback,
    which is fine for one replica but breaks streams that hop between replicas."""
    value = explicit or os.environ.get(STATE_KEY_ENV)
    if value:
        return value.encode(), True
    return secrets.token_bytes(32), False


class StreamStateCodec:
    """Serialize + sign, and verify + deserialize, stream states."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 8:
            raise ValueError("the stream state key must be at least 8 bytes")
        self._key = key

    def _sign(self, payload: bytes) -> str:
        digest = hmac.new(self._key, _VERSION.encode() + b"." + payload, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def encode(self, state: dict[str, Any]) -> str:
        raw = json.dumps(state, separators=(",", ":"), ensure_ascii=False).encode()
        payload = base64.urlsafe_b64encode(zlib.compress(raw, 6)).rstrip(b"=")
        return f"{_VERSION}.{payload.decode()}.{self._sign(payload)}"

    def decode(self, token: str) -> dict[str, Any]:
        if not isinstance(token, str) or len(token) > MAX_STATE_CHARS:
            raise StreamStateError("stream_state is not a state this server issued")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _VERSION:
            raise StreamStateError("stream_state has an unknown format")
        payload = parts[1].encode()
        if not hmac.compare_digest(self._sign(payload), parts[2]):
            raise StreamStateError(
                "stream_state signature does not match: tampered, or issued by a render "
                "server with a different --state-key"
            )
        try:
            raw = zlib.decompress(base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4)))
            state = json.loads(raw)
        except (binascii.Error, zlib.error, ValueError) as exc:
            raise StreamStateError("stream_state payload is corrupt") from exc
        if not isinstance(state, dict):
            raise StreamStateError("stream_state payload is corrupt")
        return state
