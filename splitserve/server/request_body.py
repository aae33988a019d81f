"""Reading and validating JSON request bodies for the render and OpenAI apps.

Bodies are read with a size cap (413 past it) and validated into the frontend's pydantic
models here, so every client mistake becomes an OpenAI-style 4xx naming the field.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from splitserve.frontend.protocol import RequestError
from splitserve.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is larger than the limit of {max_bytes} bytes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise APIError(413, f"request body is larger than the limit of {max_bytes} bytes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc


def validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ())]
    param = prefix + ".".join(location) if location else (prefix.rstrip(".") or None)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {message}", param=param)


def parse_model(model: type[ModelT], data: Any, prefix: str = "") -> ModelT:
    if not isinstance(data, dict):
        raise APIError(400, f"{prefix.rstrip('.') or 'request body'} must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from exc


def api_error(exc: RequestError) -> APIError:
    return APIError(exc.status, exc.message, param=exc.param)
