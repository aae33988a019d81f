"""Per-request sampling parameters (the `sampling_params` object of the generate API).

One field is ours, not vLLM's: `preceding_output_tokens`, the output tokens that precede a
resumed request's (a migrated request's prompt ends with them). A seeded request draws its
noise from (seed, output position), so it continues the undisturbed run; the field moves
nothing else (not max_tokens, nor usage).

Torch-free: the render tier builds them, the router edits them (`dataclasses.replace`),
the engine's sampler reads them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from splitserve.protocol.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    # None: as many as the context leaves (vLLM's null), resolved by `for_context` where
    # the model's length is known (the engine); the tiers in front pass it on as null
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs; 0: logprob of the sampled token; n > 0: also the top n.
    logprobs: int | None = None
    # Output tokens that precede this request's: a request resumed after k streamed tokens
    # (a migrated one, its prompt extended by them) says k, so a seeded request draws
    # at output position k + i what the undisturbed run drew there. Moves nothing else.
    preceding_output_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 1

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(f"sampling_params.{name} {why} (got {value!r})", param=name)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be a number in [0, 100]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer: -1 or 0 (disabled) or >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be a 64-bit integer or null")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a boolean")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be null or an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.preceding_output_tokens) or not 0 <= self.preceding_output_tokens < 2**31:
            raise bad("preceding_output_tokens", "must be an integer in [0, 2**31)")

    def for_context(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """These parameters with a null max_tokens resolved: what the context leaves."""
        if self.max_tokens is not None:
            return self
        return dataclasses.replace(self, max_tokens=max(1, max_model_len - prompt_len))

    def to_wire(self) -> dict[str, Any]:
        """The JSON object; `preceding_output_tokens`, ours alone, only when set."""
        wire: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }
        if self.preceding_output_tokens:
            wire["preceding_output_tokens"] = self.preceding_output_tokens
        return wire

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON object; unknown keys and invalid values raise
        InvalidRequestError naming the field. JSON null means the default."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidRequestError("sampling_params must be an object", param="sampling_params")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(
                f"sampling_params has unknown field(s): {', '.join(unknown)}", param=unknown[0]
            )
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if value is None and key not in ("seed", "logprobs"):
                continue
            if key == "stop_token_ids":
                if not isinstance(value, (list, tuple)):
                    raise InvalidRequestError(
                        "sampling_params.stop_token_ids must be a list of integers", param=key
                    )
                value = tuple(value)
            if key in ("temperature", "top_p") and _is_int(value):
                value = float(value)
            kwargs[key] = value
        return cls(**kwargs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(float(value))  # type: ignore[arg-type]
