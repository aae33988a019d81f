"""Errors the engine raises for bad requests; the HTTP layer maps them to status codes."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt exceeds max_model_len or can never fit the whole KV budget (HTTP 413)."""


class UnknownRequestError(KeyError):
    """No request with this ID is known to the engine (HTTP 404)."""
