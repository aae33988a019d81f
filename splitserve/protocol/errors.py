"""The errors every tier raises for a client, and their OpenAI body.

A tier raises a domain error (`InvalidRequestError`, `ModelNotFoundError`, or an
`APIError` with a status); the HTTP edge (`runtime/http_edge.py`) is the one place that
turns them into a status code and `{"error": {message, type, param, code}}`. An HTTP
client of another tier turns such a body back into an `APIError` with `from_body`.
"""

from __future__ import annotations

from typing import Any

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error reported to the client as-is: an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        *,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # a 429/503's `Retry-After`

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    @classmethod
    def from_body(cls, status: int, payload: Any, what: str) -> APIError:
        """An error another tier answered (`payload`: its parsed JSON, or raw text);
        `what` names that tier in the message when the body is not an OpenAI error."""
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict):
            code = error.get("code")
            return cls(
                status,
                str(error.get("message")),
                error.get("param") if isinstance(error.get("param"), str) else None,
                code if isinstance(code, str) else None,
            )
        if isinstance(error, str):
            return cls(status, error)
        return cls(status, f"{what} answered {status}: {str(payload)[:500]}")


class InvalidRequestError(APIError, ValueError):
    """Bad input (HTTP 400 unless `status` says otherwise); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400) -> None:
        super().__init__(status, message, param)


class PromptTooLongError(InvalidRequestError):
    """The prompt exceeds max_model_len or can never fit the whole KV budget (HTTP 413)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param, status=413)


class ModelNotFoundError(InvalidRequestError):
    """A request named a model this server does not serve (HTTP 404)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model!r} does not exist", "model", status=404)
        self.code = "model_not_found"


def check_model(model: str | None, served: str) -> None:
    """The one model check: None (unspecified) or the served name."""
    if model is not None and model != served:
        raise ModelNotFoundError(model)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }
