"""What the model tests of the demo model share."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.frontend.gguf_tokenizer import GGUFRenderFiles, load_gguf_render_files


@pytest.fixture(scope="package")
def demo_render_files(demo_model: Path) -> GGUFRenderFiles:
    """The demo model's tokenizer and chat template, read from its GGUF once for the
    package (parsing its 49k-token vocabulary takes seconds); the tests only read them."""
    return load_gguf_render_files(demo_model)
