"""The `/inference/v1/generate` wire shapes: request parsing and engine output -> chunks.

Field names follow vLLM's token-in/token-out protocol
(`vllm/entrypoints/scale_out/token_in_token_out/protocol.py`) so that either side can be
vLLM. Unknown-field policy: a field we neither know nor can ignore safely is a 400 naming
it (a typo must not silently change a request). Fields vLLM's render tier sends are
accepted when they ask for nothing we lack (e.g. `n: 1`, `presence_penalty: 0`,
`output_mode: "tokens"`) and rejected with a 400 naming the field when they ask for
something this engine cannot do (e.g. `n: 2`, `stop: ["x"]`, which needs a tokenizer).
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protocol.errors import APIError, InvalidRequestError
from splitserve.protocol.kv_transfer import check_kv_transfer_params
from splitserve.protocol.multimodal import FeaturesError, ImageInput, features_from_wire
from splitserve.protocol.openai_chunks import usage_dict

_REQUEST_FIELDS = frozenset(
    {
        "request_id",
        "token_ids",
        "sampling_params",
        "stream",
        "stream_options",
        "cache_salt",
        "kv_transfer_params",
        "features",
        "return_token_ids",
    }
)
# vLLM GenerateRequest fields that carry no meaning for a token engine without a
# tokenizer, structured outputs or multimodal support: accepted at these values only.
_IGNORED_REQUEST_VALUES: dict[str, tuple[Any, ...]] = {
    "model": (),  # any value: a token engine serves one model
    "block_hashes": (),  # any value: the engine hashes the prompt itself
    "token_offsets": (),
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


class GenerateRequest(NamedTuple):
    request_id: str
    token_ids: tuple[int, ...]  # immutable: the engine takes it without copying
    sampling_params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    cache_salt: str | None
    kv_transfer_params: dict | None
    images: tuple[ImageInput, ...] = ()  # from `features`; pixels None: load by hash


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


def _parse_sampling_params(raw: Any, prompt_len: int, max_model_len: int | None) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise APIError(400, "sampling_params must be an object", param="sampling_params")
    _check_ignored(raw, _NEUTRAL_SAMPLING_VALUES, "sampling_params.")
    params = {k: v for k, v in raw.items() if k not in _NEUTRAL_SAMPLING_VALUES and not k.startswith("_")}
    if "max_tokens" in params and params["max_tokens"] is None:
        # vLLM's meaning: as many as the context leaves room for
        if max_model_len is None:
            del params["max_tokens"]
        else:
            params["max_tokens"] = max(1, max_model_len - prompt_len)
    try:
        return SamplingParams.from_dict(params)
    except InvalidRequestError as exc:
        param = getattr(exc, "param", None)
        if param and not param.startswith("sampling_params"):
            param = f"sampling_params.{param}"
        raise APIError(400, str(exc), param=param or "sampling_params") from exc


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


def parse_generate_request(
    body: Any, *, max_model_len: int | None = None, max_pixel_bytes: int = DEFAULT_MAX_PIXEL_BYTES
) -> GenerateRequest:
    """Validate a `/inference/v1/generate` body; every problem is an `APIError` (400)."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - _REQUEST_FIELDS - set(_IGNORED_REQUEST_VALUES))
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
    _check_ignored(body, _IGNORED_REQUEST_VALUES, "")
    if "token_ids" not in body:
        raise APIError(400, "token_ids is required", param="token_ids")
    token_ids = _parse_token_ids(body["token_ids"])

    request_id = body.get("request_id")
    if request_id is None:
        request_id = f"gen-{uuid.uuid4().hex}"
    elif not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise APIError(
            400,
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} characters",
            param="request_id",
        )

    stream_options = body.get("stream_options")
    if stream_options is None:
        stream_options = {}
    if not isinstance(stream_options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    unknown = sorted(set(stream_options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise APIError(
            400, f"unknown field 'stream_options.{unknown[0]}'", param=f"stream_options.{unknown[0]}"
        )

    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (
        not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_LENGTH
    ):
        raise APIError(
            400,
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LENGTH} characters",
            param="cache_salt",
        )
    kv_transfer_params = body.get("kv_transfer_params")
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise APIError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    if kv_transfer_params is not None:
        check_kv_transfer_params(kv_transfer_params)
    images = parse_features(body.get("features"), max_pixel_bytes)

    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling_params=_parse_sampling_params(body.get("sampling_params"), len(token_ids), max_model_len),
        stream=_optional_bool(body, "stream"),
        include_usage=_optional_bool(stream_options, "include_usage", "stream_options.include_usage"),
        continuous_usage=_optional_bool(
            stream_options, "continuous_usage_stats", "stream_options.continuous_usage_stats"
        ),
        return_token_ids=_optional_bool(body, "return_token_ids"),
        cache_salt=cache_salt,
        kv_transfer_params=kv_transfer_params,
        images=images,
    )


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None) -> dict:
    """vLLM's UsageInfo, with the cached count both where OpenAI puts it
    (`prompt_tokens_details.cached_tokens`) and flat (`cached_tokens`)."""
    result: dict[str, Any] = usage_dict(num_prompt_tokens, num_completion_tokens)
    if num_cached_tokens is not None:
        result["cached_tokens"] = num_cached_tokens
        result["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return result


PROMPT_SOURCES = (
    "prompt_tokens_reused",
    "prompt_tokens_pulled",
    "prompt_tokens_received",
    "prompt_tokens_computed",
)


def prompt_sources(times: dict | None, num_prompt_tokens: int) -> dict[str, int | None]:
    """Where this request's prompt KV came from: reused from the local prefix cache (by
    block hash), pulled from the prefix a decode worker held (prefill in bidirectional P/D,
    also by block hash), received from another worker that computed it for this request,
    or computed here; and the first block neither reused nor pulled (where reuse stopped).
    None before the request was scheduled."""
    times = times or {}
    local, received = times.get("prefix_hit_tokens"), times.get("received_tokens")
    if local is None or received is None:
        return dict.fromkeys((*PROMPT_SOURCES, "prompt_reuse_stopped_block"))
    pulled = int(times.get("pulled_tokens") or 0)
    block_size = int(times.get("block_size") or 1)
    return {
        "prompt_tokens_reused": int(local),
        "prompt_tokens_pulled": pulled,
        "prompt_tokens_received": max(int(received) - pulled, 0),
        "prompt_tokens_computed": max(num_prompt_tokens - int(local) - int(received), 0),
        "prompt_reuse_stopped_block": (int(local) + pulled) // block_size,
    }


def request_metrics(times: dict | None, num_output_tokens: int) -> dict:
    """vLLM's PerRequestMetrics from the engine's timestamps (seconds, one clock)."""
    times = times or {}
    arrival = times.get("arrival_time")
    scheduled = times.get("first_scheduled_time")
    first = times.get("first_token_time")
    last = times.get("last_token_time")
    result: dict[str, float | None] = {
        "time_to_first_token_ms": None,
        "generation_time_ms": None,
        "queue_time_ms": None,
        "mean_itl_ms": None,
        "tokens_per_second": None,
    }
    if arrival is not None and scheduled is not None:
        result["queue_time_ms"] = (scheduled - arrival) * 1e3
    if arrival is not None and first is not None:
        result["time_to_first_token_ms"] = (first - arrival) * 1e3
    if first is not None and last is not None:
        result["generation_time_ms"] = (last - first) * 1e3
        if num_output_tokens > 1 and last > first:
            result["mean_itl_ms"] = (last - first) * 1e3 / (num_output_tokens - 1)
            result["tokens_per_second"] = (num_output_tokens - 1) / (last - first)
    return result


def _logprobs(entries: list[dict]) -> dict:
    """vLLM's GenerateLogProbs: the sampled token first, then its top candidates."""
    content = []
    for entry in entries:
        top = [
            {"token_id": int(token_id), "logprob": float(logprob), "rank": rank}
            for rank, (token_id, logprob) in enumerate(entry.get("top_logprobs") or [], start=1)
        ]
        content.append(
            {"token_id": int(entry["token_id"]), "logprob": float(entry["logprob"]), "top_logprobs": top}
        )
    return {"content": content}


def stop_reason(request: GenerateRequest, output: RequestOutput) -> int | None:
    """vLLM's stop_reason: the stop token that ended generation; None on EOS/length/abort."""
    if output.finish_reason == "stop" and output.new_token_ids:
        last = output.new_token_ids[-1]
        if last in request.sampling_params.stop_token_ids:
            return int(last)
    return None


class ChunkBuilder:
    """Turns one request's engine outputs into stream chunks (delta token IDs)."""

    def __init__(self, request: GenerateRequest):
        self.request = request
        self.num_prompt_tokens = len(request.token_ids)
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None
        self._sent_prompt_ids = False

    def chunk(self, output: RequestOutput, *, force_usage: bool = False) -> dict:
        self.num_output_tokens += len(output.new_token_ids)
        self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        finished = output.finished
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": [int(t) for t in output.new_token_ids],
            "finish_reason": output.finish_reason if finished else None,
            "stop_reason": stop_reason(self.request, output) if finished else None,
        }
        if self.request.sampling_params.logprobs is not None:
            choice["logprobs"] = _logprobs(output.new_logprobs or [])
        chunk: dict[str, Any] = {"request_id": self.request.request_id, "choices": [choice]}
        if self.request.return_token_ids and not self._sent_prompt_ids:
            chunk["prompt_token_ids"] = self.request.token_ids
            self._sent_prompt_ids = True
        wants_usage = force_usage or self.request.include_usage
        if self.request.continuous_usage or (finished and wants_usage):
            chunk["usage"] = usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)
        if finished:
            chunk["kv_transfer_params"] = output.kv_transfer_params
            chunk["metrics"] = request_metrics(output.metrics, self.num_output_tokens)
            chunk["metrics"].update(prompt_sources(output.metrics, self.num_prompt_tokens))
        return chunk
