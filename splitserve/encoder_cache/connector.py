"""The encoder-cache (EC) connector seam: visual embeddings computed by an encoder worker,
found by image hash, loaded by the prefill/decode engine.

Same shape as the KV connector (`splitserve.kv.connector.base`): one object per engine holds
both halves.

Scheduler half (the engine thread, when a request is added):
  `has_cache(image_hash)` — whether embeddings for the image can be loaded. An image the
  request sends without pixels must be here, or the request is refused (HTTP 400).

Worker half (inside the runner's step, when a step first needs an image's visual tokens
and the engine's own encoder cache lacks them):
  `load_cache(image_hash, device)` — the embeddings [tokens, hidden], or None when they
  are gone or unreadable: the engine then runs the vision tower itself if it has the
  pixels (slower, never lost).
  `save_cache(image_hash, embeddings)` — an encoder worker publishes what it computed;
  an engine that had to encode publishes it too, so the next engine finds it.

The shared-memory implementation (one host) keeps one file per image in a directory on
tmpfs; a transport across hosts plugs in at the same interface.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Image hashes name files: hex only, so a client-supplied hash can never name a path.
IMAGE_HASH_PATTERN = re.compile(r"^[0-9a-f]{16,128}$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_image_hash(image_hash: str) -> None:
    if not isinstance(image_hash, str) or not IMAGE_HASH_PATTERN.match(image_hash):
        raise ValueError("an image hash is 16 to 128 lowercase hex digits")


class ECConnector(ABC):
    # ---- scheduler half -----------------------------------------------------------
    @abstractmethod
    def has_cache(self, image_hash: str) -> bool:
        """Whether embeddings for `image_hash` can be loaded."""

    # ---- worker half --------------------------------------------------------------
    @abstractmethod
    def load_cache(self, image_hash: str, device: torch.device) -> torch.Tensor | None:
        """The embeddings [visual tokens, hidden] on `device`, or None if unavailable."""

    @abstractmethod
    def save_cache(self, image_hash: str, embeddings: torch.Tensor) -> None:
        """Publish embeddings [visual tokens, hidden] under `image_hash`."""

    def shutdown(self) -> None:  # noqa: B027
        """Release threads, sockets and files."""


def default_shm_directory(name: str = "default") -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"splitserve-ec-{name}"


class SharedMemoryECConnector(ECConnector):
    """One file per image hash in a tmpfs directory shared by the processes of one host:
    a 4-byte header length, a JSON header {dtype, shape}, then the raw tensor bytes.
    Files appear and are replaced atomically (written aside, then renamed), so a reader
    sees a whole entry or none."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, image_hash: str) -> Path:
        check_image_hash(image_hash)
        return self.directory / f"{image_hash}.ec"

    def has_cache(self, image_hash: str) -> bool:
        return self._path(image_hash).is_file()

    def load_cache(self, image_hash: str, device: torch.device) -> torch.Tensor | None:
        try:
            data = self._path(image_hash).read_bytes()
            (header_len,) = struct.unpack_from("<I", data)
            header = json.loads(data[4 : 4 + header_len])
            dtype, shape = _DTYPES[header["dtype"]], tuple(int(n) for n in header["shape"])
            payload = bytearray(data[4 + header_len :])
            tensor = torch.frombuffer(payload, dtype=dtype).view(shape)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, RuntimeError, struct.error) as exc:
            logger.warning("encoder cache entry %s is unreadable (%s); recomputing", image_hash[:16], exc)
            return None
        return tensor.to(device)

    def save_cache(self, image_hash: str, embeddings: torch.Tensor) -> None:
        path = self._path(image_hash)  # replaced if there: a recomputed entry fixes a bad one
        tensor = embeddings.detach().contiguous().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        header = json.dumps({"dtype": dtype, "shape": list(tensor.shape)}).encode()
        payload = tensor.view(torch.uint8).numpy().tobytes()
        fd, staging = tempfile.mkstemp(dir=self.directory, prefix=".staging-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(struct.pack("<I", len(header)) + header + payload)
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
