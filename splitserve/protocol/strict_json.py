"""Strict JSON for request bodies: what `json.loads` accepts but no tier can serve.

Python's parser takes `NaN` and `±Infinity` literals, `1e999` (infinite), integers of
thousands of digits (a `ValueError` past 4,300), nesting until `RecursionError`, and
`"\\ud800"` escapes that make a string no UTF-8 encoder can write back. Each of these used
to reach a handler or the engine and end as a 5xx; here each is a 400 for that request
alone, before anything else reads the body.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

from splitserve.protocol.errors import InvalidRequestError


class JSONLimits(NamedTuple):
    max_depth: int = 64  # the deepest real request (tools' JSON schemas) is far shallower
    max_int_chars: int = 21  # a signed 64-bit integer (20 characters) or an unsigned one


DEFAULT_JSON_LIMITS = JSONLimits()


def _refuse_constant(name: str) -> Any:
    raise InvalidRequestError(f"request body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequestError(f"request body is not valid JSON: {text[:40]} is out of range")
    return value


def _checked_int(limits: JSONLimits, text: str) -> int:
    if len(text) > limits.max_int_chars:
        raise InvalidRequestError(
            f"request body has an integer of {len(text)} characters (the limit is {limits.max_int_chars})"
        )
    return int(text)


def _check_string(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                "request body is not valid UTF-8: it has a lone surrogate escape (\\ud800-\\udfff)"
            ) from exc


def _check_tree(value: Any, limits: JSONLimits) -> None:
    """Depth and strings, without recursion (a deep tree must not exhaust the stack)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            _check_string(item)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > limits.max_depth:
            raise InvalidRequestError(f"request body nests deeper than {limits.max_depth} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_string(key)
                pending.append((child, depth + 1))
        else:
            pending.extend((child, depth + 1) for child in item)


def loads_strict(body: bytes, limits: JSONLimits = DEFAULT_JSON_LIMITS) -> Any:
    """Parse a request body, or raise `InvalidRequestError` saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"{exc.reason} at byte {exc.start}"
        raise InvalidRequestError(f"request body is not valid UTF-8: {reason}") from exc
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=lambda digits: _checked_int(limits, digits),
        )
    except RecursionError as exc:
        raise InvalidRequestError(f"request body nests deeper than {limits.max_depth} levels") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    _check_tree(value, limits)
    return value
