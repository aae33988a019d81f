"""The HTTP edge every app shares: bounded JSON bodies, validation into typed values, SSE
framing, and the one place where errors become a status code and an OpenAI error body.

Bodies are read with a size cap (413 past it) and validated into pydantic models here, so
every client mistake becomes an OpenAI-style 4xx naming the field; an unexpected
exception becomes a 500 for that request only, and the app keeps serving.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.protocol.errors import APIError, InvalidRequestError, error_body
from splitserve.protocol.strict_json import loads_strict

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ModelT = TypeVar("ModelT", bound=BaseModel)


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def read_json_body(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is larger than the limit of {max_bytes} bytes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise APIError(413, f"request body is larger than the limit of {max_bytes} bytes")
    return loads_strict(bytes(body))


def validation_error(exc: ValidationError, prefix: str = "") -> InvalidRequestError:
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ())]
    param = prefix + ".".join(location) if location else (prefix.rstrip(".") or None)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequestError(f"{param or 'body'}: {message}", param=param)


def parse_model(model: type[ModelT], data: Any, prefix: str = "") -> ModelT:
    """Validate a JSON value into `model`, once, at the edge."""
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{prefix.rstrip('.') or 'request body'} must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from exc


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every error to its status and OpenAI body: the one place that does."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while handling a request")
        return error_response(500, f"internal error: {type(exc).__name__}")
