"""Opening a GGUF file (llama.cpp's checkpoint format) and reading its metadata.

Shared by the engine (weights, shapes) and the render tier (tokenizer, chat template), so
it imports only the `gguf` package (ggml-org's reader, numpy only), never torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

GGUF_SUFFIX = ".gguf"


class GGUFError(ValueError):
    """A GGUF file that cannot be used: corrupt, truncated or unsupported."""


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


def open_gguf(path: str | Path) -> GGUFReader:
    """A memory-mapped reader; a clear GGUFError for anything that is not a whole GGUF."""
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
