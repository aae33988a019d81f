"""A keyed MAC on every KV control and data message, derived from the deployment's
internal token: a KV socket acts only on messages from the deployment's own engines
(raw ZeroMQ frames from anyone else are dropped, and a fake peer's replies are refused).

Without an internal token (an open loopback deployment) messages carry no tag and every
message is accepted, as before. Not covered: replaying a captured message (no nonce) and
confidentiality (KV crosses in clear; use a private network or a tunnel across hosts).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

_LABEL = b"splitserve kv frames v1"
TAG_BYTES = 32


def _view(frame: Any) -> Any:
    """The bytes of a frame: bytes, a memoryview, or a zmq.Frame (its buffer)."""
    return getattr(frame, "buffer", frame)


class FrameMac:
    def __init__(self, secret: str | None):
        self._key = hmac.new(secret.encode(), _LABEL, hashlib.sha256).digest() if secret else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _tag(self, frames: Sequence[Any]) -> bytes:
        assert self._key is not None
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            view = memoryview(_view(frame)).cast("B")
            mac.update(len(view).to_bytes(8, "big"))  # frame boundaries are part of the message
            mac.update(view)
        return mac.digest()

    def seal(self, frames: list[Any]) -> list[Any]:
        """`frames` with their tag appended (unchanged without a key)."""
        return [*frames, self._tag(frames)] if self._key is not None else frames

    def open(self, frames: list[Any]) -> list[Any] | None:
        """The frames without their tag when it is valid; None when it is not."""
        if self._key is None:
            return frames
        if len(frames) < 2:
            return None
        body, tag = frames[:-1], bytes(_view(frames[-1]))
        return body if hmac.compare_digest(tag, self._tag(body)) else None
