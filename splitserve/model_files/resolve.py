"""What a MODEL argument names, as a path every tier can open.

- nothing: the demo model (SmolLM2-135M-Instruct, fetched on first use: `demo.py`);
- a GGUF file, or a directory holding exactly one GGUF and no config.json;
- a Hugging Face model directory (config.json);
- a Hugging Face ID (`org/name`): the snapshot in the standard Hugging Face cache,
  looked up offline first and downloaded only when it is not cached and
  `HF_HUB_OFFLINE` is not set.

No torch here: the render tier and `splitserve up` resolve models too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from splitserve.gguf_file import GGUF_SUFFIX
from splitserve.model_files.demo import SMOLLM2_135M_INSTRUCT, DemoModelUnavailable, ensure_demo_model

_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a serving snapshot needs; GGUF repositories are named by file instead.
_HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt"]


class ModelNotFoundError(ValueError):
    """A MODEL argument that names no usable checkpoint; the message says why."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # a model directory or a GGUF file
    name: str  # the name clients use unless --served-model-name says otherwise


def _in_directory(directory: Path) -> ResolvedModel:
    if (directory / "config.json").is_file():
        return ResolvedModel(str(directory), directory.resolve().name)
    ggufs = sorted(p for p in directory.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    if len(ggufs) == 1:
        return ResolvedModel(str(ggufs[0]), ggufs[0].stem)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"{directory} holds several GGUF files ({names}); name one of them")
    raise ModelNotFoundError(f"{directory} is not a model directory (no config.json and no .gguf file)")


def _from_hugging_face_cache(repo_id: str) -> ResolvedModel:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set "
                f"(download it with `hf download {repo_id}` where the Hub is reachable)"
            ) from None
        try:
            snapshot = snapshot_download(repo_id, allow_patterns=_HF_ALLOW_PATTERNS)
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
            raise ModelNotFoundError(f"{repo_id!r} is not cached and cannot be downloaded: {exc}") from None
    resolved = _in_directory(Path(snapshot))
    return ResolvedModel(resolved.path, repo_id)


def resolve_model(model: str | None) -> ResolvedModel:
    """The checkpoint a MODEL argument names (see the module docstring)."""
    if not model:
        return ResolvedModel(str(ensure_demo_model()), SMOLLM2_135M_INSTRUCT.name)
    path = Path(model)
    if path.is_file():
        if path.suffix.lower() != GGUF_SUFFIX:
            raise ModelNotFoundError(f"{model!r} is a file but not a GGUF file (*.gguf)")
        return ResolvedModel(str(path), path.stem)
    if path.is_dir():
        return _in_directory(path)
    if _HF_ID.fullmatch(model) and not model.startswith((".", "/")):
        return _from_hugging_face_cache(model)
    raise ModelNotFoundError(
        f"{model!r} is neither a GGUF file, a model directory nor a Hugging Face ID (org/name)"
    )


def resolve_model_or_exit(model: str | None) -> ResolvedModel:
    """`resolve_model` for commands: a clear message and a non-zero exit instead of a traceback."""
    try:
        return resolve_model(model)
    except (ModelNotFoundError, DemoModelUnavailable) as exc:
        raise SystemExit(f"splitserve: {exc}") from None
