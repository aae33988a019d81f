"""What a model directory's config.json says about its architecture, read without torch
(`splitserve up` checks a model before it starts any engine)."""

from __future__ import annotations

import json
from pathlib import Path

# hybrid attention + Mamba2 models (splitserve/model/nemotron_h.py)
HYBRID_ARCHITECTURES = ("NemotronHForCausalLM",)


def is_hybrid_model(model_path: str | Path) -> bool:
    """A Hugging Face directory whose config.json names a hybrid (Mamba) model; GGUF files
    never do."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return any(a in HYBRID_ARCHITECTURES for a in raw.get("architectures") or [])
