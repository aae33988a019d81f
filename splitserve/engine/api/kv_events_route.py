"""`GET /inference/v1/kv/events`: where this engine publishes its KV cache events, so a
router that knows the engine's URL finds its event stream (`protocol/kv_events.py`)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from splitserve.config import KVEventsConfig


def install_kv_events_route(app: FastAPI, config: KVEventsConfig, block_size: int) -> None:
    @app.get("/inference/v1/kv/events")
    async def kv_events() -> JSONResponse:
        return JSONResponse(
            {
                "endpoint": config.endpoint,
                "replay_endpoint": config.replay_endpoint,
                "topic": config.topic,
                "block_size": block_size,
            }
        )
