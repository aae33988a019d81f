"""The in-process engine the engine API tests share (a module may define its own `engine`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve.engine.async_engine import AsyncEngine
from tests.engine.api.helpers import engine_config


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(engine_config(tiny_model))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()
