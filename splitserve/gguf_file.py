"""Opening a GGUF file (llama.cpp's checkpoint format) and reading its metadata.

Shared by the engine (weights, shapes) and the render tier (tokenizer, chat template), so
it imports only the `gguf` package (ggml-org's reader, numpy only), never torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gguf import GGUFReader

GGUF_SUFFIX = ".gguf"
# The readers `open_gguf` hands out inside `shared_gguf_readers()`, by file (path, mtime, size).
_SHARED_READERS: contextvars.ContextVar[dict[tuple[str, int, int], GGUFReader] | None] = (
    contextvars.ContextVar("splitserve_gguf_readers", default=None)
)


class GGUFError(ValueError):
    """A GGUF file that cannot be used: corrupt, truncated or unsupported."""


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """Within the block, `open_gguf` parses each file once and hands later callers the same
    reader: a model load reads the file for its config, its quantization plan and its
    weights, and the metadata of a large vocabulary takes seconds to parse each time (the
    demo model's 49k tokens and merges: ~3 s on one core). The readers are read-only memory
    maps, dropped when the outermost block ends."""
    if _SHARED_READERS.get() is not None:  # nested: the outer block's readers serve
        yield
        return
    token = _SHARED_READERS.set({})
    try:
        yield
    finally:
        _SHARED_READERS.reset(token)


def open_gguf(path: str | Path) -> GGUFReader:
    """A memory-mapped reader; a clear GGUFError for anything that is not a whole GGUF.
    Inside `shared_gguf_readers()`, the reader of an unchanged file opened before."""
    readers = _SHARED_READERS.get()
    if readers is None:
        return _read_gguf(path)
    try:
        stat = os.stat(path)
    except OSError:  # the reader says what is wrong
        return _read_gguf(path)
    key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
    if key not in readers:
        readers[key] = _read_gguf(path)
    return readers[key]


def _read_gguf(path: str | Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except FileNotFoundError:
        raise
    # The reader fails on a bad file with whatever numpy or struct says (a reshape, an
    # unknown enum value, a slice past the end): name the file and the likely cause.
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError, MemoryError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python value (str, int, float, bool or a list of them)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise GGUFError(f"GGUF metadata {key!r} cannot be read: {exc}") from exc
