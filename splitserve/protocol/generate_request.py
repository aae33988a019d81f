"""The `/inference/v1/generate` request, typed: built once by the render tier, edited by
the router with `dataclasses.replace`, parsed once at the engine's edge, and carried whole
into the engine's `Request`. Torch-free.

Field names follow vLLM's token-in/token-out protocol
(`vllm/entrypoints/scale_out/token_in_token_out/protocol.py`) so that either side can be
vLLM. Unknown-field policy: a field we neither know nor can ignore safely is a 400 naming
it (a typo must not silently change a request). Fields vLLM's render tier sends are
accepted when they ask for nothing we lack (e.g. `n: 1`, `presence_penalty: 0`,
`output_mode: "tokens"`) and rejected with a 400 naming the field when they ask for
something this engine cannot do (e.g. `n: 2`, `stop: ["x"]`, which needs a tokenizer);
accepted, they are dropped (`to_wire` does not send them on), but for `model` and
`block_hashes`, which the router reads.

The proxy's routing hints (`conversation_id`, `prompt_text`) travel from the render tier
to the router only: `from_wire` reads them with `routing_hints=True` (the router's edge;
an engine refuses them as unknown fields) and `to_wire` writes them only when asked (the
render tier's edge), so no engine ever gets them.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from splitserve.protocol.errors import APIError, InvalidRequestError
from splitserve.protocol.kv_transfer import KV_TRANSFER_PARAMS, KVTransferParams, parse_kv_transfer_params
from splitserve.protocol.multimodal import (
    FeaturesError,
    ImageInput,
    features_from_wire,
    features_without_pixels,
)
from splitserve.protocol.sampling_params import SamplingParams

_REQUEST_FIELDS = frozenset(
    {
        "request_id",
        "token_ids",
        "sampling_params",
        "stream",
        "stream_options",
        "cache_salt",
        KV_TRANSFER_PARAMS,
        "features",
        "return_token_ids",
        "model",
        "block_hashes",
    }
)
CONVERSATION_ID = "conversation_id"  # routing hint: the client's conversation
PROMPT_TEXT = "prompt_text"  # routing hint: the client's prompt text, for the text-prefix router
ROUTING_HINTS = (CONVERSATION_ID, PROMPT_TEXT)  # for the proxy's placement only, never sent to an engine
# vLLM GenerateRequest fields that carry no meaning for a token engine without a
# tokenizer, structured outputs or multimodal support: accepted at these values only.
_IGNORED_REQUEST_VALUES: dict[str, tuple[Any, ...]] = {
    "token_offsets": (),  # any value
    "reasoning_ended": (),  # only gates structured outputs, which this engine has none of
    "reasoning_parser_kwargs": (),
    "priority": (0, None),
    "output_mode": ("tokens", None),
    "ec_transfer_params": (None,),
    "content_parts": (None, []),
}
# vLLM SamplingParams fields at their neutral values (ours has no such knob).
_NEUTRAL_SAMPLING_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "min_tokens": (0, None),
    "stop": (None, [], ""),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "extra_args": (None, {}),
    "truncate_prompt_tokens": (None,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "watermarking": (None, False),
    "logprob_token_ids": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "flat_logprobs": (False, None),
    "skip_reading_prefix_cache": (None, False),
    "stream_interval": (None, 1),
    # Text-side switches: no text is produced here, so any value is harmless.
    "detokenize": (),
    "skip_special_tokens": (),
    "spaces_between_special_tokens": (),
    "include_stop_str_in_output": (),
    "output_kind": (),
    "skip_clone": (),
}
MAX_REQUEST_ID_LENGTH = 256
MAX_CACHE_SALT_LENGTH = 1024
# decoded pixels of one request's `features` (the render tier's max_pixel_bytes_per_request)
DEFAULT_MAX_PIXEL_BYTES = 64 * 2**20


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    token_ids: tuple[int, ...]  # immutable: the engine takes it without copying
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    return_token_ids: bool = False
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # the images in wire form (protocol/multimodal.py); parsed with a pixel limit (the
    # engine's edge), without pixels: those are in `images`, decoded
    features: dict[str, Any] | None = None
    images: tuple[ImageInput, ...] = ()  # decoded at the engine's edge; pixels None: load by hash
    model: str | None = None  # any value accepted: an engine serves one model
    block_hashes: tuple[str, ...] | None = None  # the render tier's, hex: the router matches them
    conversation_id: str | None = None  # routing hint: the client's conversation
    prompt_text: str | None = None  # routing hint: the prompt's text, for the text-prefix router

    @classmethod
    def from_wire(
        cls,
        body: Any,
        *,
        max_model_len: int | None = None,
        max_pixel_bytes: int | None = DEFAULT_MAX_PIXEL_BYTES,
        routing_hints: bool = False,
    ) -> GenerateRequest:
        """Validate a `/inference/v1/generate` body: every problem is an `APIError` (400;
        413 for images past `max_pixel_bytes`). With `max_model_len` (an engine's edge), a
        null max_tokens becomes what the context leaves; without (the router), it stays
        null. `max_pixel_bytes=None` (the router, which never reads pixels): `features`
        pass on as sent, for the engine to check."""
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        known = _REQUEST_FIELDS | set(_IGNORED_REQUEST_VALUES)
        if routing_hints:
            known |= set(ROUTING_HINTS)
        unknown = sorted(set(body) - known)
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
        _check_ignored(body, _IGNORED_REQUEST_VALUES, "")
        if "token_ids" not in body:
            raise APIError(400, "token_ids is required", param="token_ids")
        token_ids = _parse_token_ids(body["token_ids"])
        # checked in this order: a body with several problems is refused for the first
        request_id = _parse_request_id(body.get("request_id"))
        stream_options = _parse_stream_options(body.get("stream_options"))
        cache_salt = _parse_cache_salt(body.get("cache_salt"))
        kv_transfer_params = parse_kv_transfer_params(body)
        features = body.get("features")
        images: tuple[ImageInput, ...] = ()
        if max_pixel_bytes is not None:
            features, images = _decoded_images(features, max_pixel_bytes)
        sampling_params = _parse_sampling_params(body.get("sampling_params"))
        if max_model_len is not None:
            sampling_params = sampling_params.for_context(len(token_ids), max_model_len)
        return cls(
            request_id=request_id,
            token_ids=token_ids,
            sampling_params=sampling_params,
            stream=_optional_bool(body, "stream"),
            include_usage=_optional_bool(stream_options, "include_usage", "stream_options.include_usage"),
            continuous_usage=_optional_bool(
                stream_options, "continuous_usage_stats", "stream_options.continuous_usage_stats"
            ),
            return_token_ids=_optional_bool(body, "return_token_ids"),
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            features=features if features not in (None, {}) else None,
            images=images,
            model=body["model"] if isinstance(body.get("model"), str) else None,
            block_hashes=_hex_strings(body.get("block_hashes")),
            conversation_id=_text(body.get(CONVERSATION_ID)) if routing_hints else None,
            prompt_text=_text(body.get(PROMPT_TEXT)) if routing_hints else None,
        )

    def at_engine(self, *, max_model_len: int | None, max_pixel_bytes: int) -> GenerateRequest:
        """This request (parsed where pixels are not read: the render tier's answer) as an
        engine takes it, what `from_wire` does at an engine's edge: the images decoded
        (400 if malformed, 413 past `max_pixel_bytes`), a null max_tokens resolved to what
        the context leaves (with `max_model_len`), and no routing hints."""
        features, images = self.features, self.images
        sampling_params = self.sampling_params
        if max_model_len is not None:
            sampling_params = sampling_params.for_context(len(self.token_ids), max_model_len)
        if features is not None and not images:
            features, images = _decoded_images(features, max_pixel_bytes)
        return dataclasses.replace(
            self,
            features=features if features not in (None, {}) else None,
            images=images,
            sampling_params=sampling_params,
            conversation_id=None,
            prompt_text=None,
        )

    def to_wire(self, *, routing_hints: bool = False) -> dict[str, Any]:
        """The JSON body an engine (ours or vLLM's) takes; with `routing_hints`, the one
        the render tier answers the proxy with."""
        body: dict[str, Any] = {
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "sampling_params": self.sampling_params.to_wire(),
        }
        if self.block_hashes is not None:
            body["block_hashes"] = list(self.block_hashes)
        body["features"] = self.features
        if self.model is not None:
            body["model"] = self.model
        body["stream"] = self.stream
        body["cache_salt"] = self.cache_salt
        if self.stream or self.include_usage or self.continuous_usage:
            options: dict[str, bool] = {"include_usage": self.include_usage}
            if self.continuous_usage:
                options["continuous_usage_stats"] = True
            body["stream_options"] = options
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.kv_transfer_params is not None:
            body[KV_TRANSFER_PARAMS] = self.kv_transfer_params.to_wire()
        if routing_hints:
            for name in ROUTING_HINTS:
                if getattr(self, name) is not None:
                    body[name] = getattr(self, name)
        return body


def _allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    if not allowed:
        return True
    for option in allowed:
        if option is None or value is None:
            if option is value:
                return True
        # JSON `true` must not pass for 1, nor `false` for 0
        elif isinstance(value, bool) == isinstance(option, bool) and value == option:
            return True
    return False


def _check_ignored(body: dict, table: dict[str, tuple[Any, ...]], prefix: str) -> None:
    for name, allowed in table.items():
        if name in body and not _allowed(body[name], allowed):
            raise APIError(
                400, f"{prefix}{name}={body[name]!r} is not supported by this engine", param=prefix + name
            )


def _parse_sampling_params(raw: Any) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise APIError(400, "sampling_params must be an object", param="sampling_params")
    _check_ignored(raw, _NEUTRAL_SAMPLING_VALUES, "sampling_params.")
    params = {k: v for k, v in raw.items() if k not in _NEUTRAL_SAMPLING_VALUES and not k.startswith("_")}
    up_to_context = "max_tokens" in params and params["max_tokens"] is None  # vLLM's null
    try:
        parsed = SamplingParams.from_dict(params)
    except InvalidRequestError as exc:
        param = getattr(exc, "param", None)
        if param and not param.startswith("sampling_params"):
            param = f"sampling_params.{param}"
        raise APIError(400, str(exc), param=param or "sampling_params") from exc
    return dataclasses.replace(parsed, max_tokens=None) if up_to_context else parsed


def _parse_token_ids(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise APIError(400, "token_ids must be a list of integers", param="token_ids")
    if not raw:
        raise APIError(400, "token_ids must not be empty", param="token_ids")
    for i, token in enumerate(raw):
        if type(token) is not int:
            raise APIError(400, f"token_ids[{i}] is not an integer: {token!r}", param="token_ids")
        if token < 0:
            raise APIError(400, f"token_ids[{i}] is negative: {token}", param="token_ids")
    return tuple(raw)


def _parse_request_id(raw: Any) -> str:
    if raw is None:
        return f"gen-{uuid.uuid4().hex}"
    if not isinstance(raw, str) or not raw or len(raw) > MAX_REQUEST_ID_LENGTH:
        raise APIError(
            400,
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} characters",
            param="request_id",
        )
    return raw


def _parse_stream_options(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    unknown = sorted(set(raw) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        name = f"stream_options.{unknown[0]}"
        raise APIError(400, f"unknown field {name!r}", param=name)
    return raw


def _parse_cache_salt(raw: Any) -> str | None:
    if raw is not None and (not isinstance(raw, str) or not raw or len(raw) > MAX_CACHE_SALT_LENGTH):
        raise APIError(
            400,
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LENGTH} characters",
            param="cache_salt",
        )
    return raw


def _optional_bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{param or name} must be a boolean", param=param or name)
    return value


def parse_features(features: Any, max_pixel_bytes: int) -> tuple[ImageInput, ...]:
    """The images of a `features` object: 400 if malformed, 413 past `max_pixel_bytes`."""
    if features in (None, {}):
        return ()
    try:
        return tuple(features_from_wire(features, max_pixel_bytes))
    except FeaturesError as exc:
        message = f"{exc} (max_pixel_bytes={max_pixel_bytes})" if exc.too_large else str(exc)
        raise APIError(413 if exc.too_large else 400, message, param="features") from exc


def _decoded_images(features: Any, max_pixel_bytes: int) -> tuple[Any, tuple[ImageInput, ...]]:
    """An engine edge's images: the `features` without their pixels, and the decoded images."""
    images = parse_features(features, max_pixel_bytes)
    return (features_without_pixels(features) if images else None), images


def _hex_strings(value: Any) -> tuple[str, ...] | None:
    """Block hashes as sent when they are a list of strings (any other value is accepted
    and dropped: the engine hashes the prompt itself)."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
