"""The one way back from engine tokens to OpenAI deltas, for the OpenAI service.

A choice starts from a `DecoderSeed` made once at render time (what the request asks of
the way back, and whether the prompt leaves the model inside reasoning) and then carries
its `ChoiceDecoder`. In process the decoder object itself is the state; over HTTP
(`/v1/derender/pieces`) the seed and the decoder's compact state travel in a signed
string, so each call costs O(new tokens) whatever the length of the conversation.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, NamedTuple

from splitserve.frontend.choice_decoder import ChoiceDecoder, DecodeOptions
from splitserve.frontend.render import Renderer
from splitserve.frontend.stream_state import StreamStateCodec, StreamStateError
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.frontend_client import DerenderedPiece, DerenderPiece
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.openai_chunks import merge_deltas


class DecoderSeed(NamedTuple):
    request_id: str  # tool call IDs derive from it and the choice index
    options: DecodeOptions
    starts_in_reasoning: bool


def chat_options(renderer: Renderer, request: ChatCompletionRequest | None) -> DecodeOptions:
    if request is None:
        return DecodeOptions(reasoning=renderer.reasoning)
    return DecodeOptions(
        stop=request.stop_strings(),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        reasoning=renderer.reasoning,
        tools=renderer.tools and request.parses_tool_calls(),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
    )


def completion_options(request: CompletionRequest) -> DecodeOptions:
    return DecodeOptions(
        stop=request.stop_strings(),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        reasoning=False,
        tools=False,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
    )


def chat_seed(renderer: Renderer, request: ChatCompletionRequest, generate: GenerateRequest) -> DecoderSeed:
    return DecoderSeed(
        generate.request_id,
        chat_options(renderer, request),
        renderer.starts_in_reasoning(list(generate.token_ids)),
    )


def completion_seed(request: CompletionRequest, generate: GenerateRequest) -> DecoderSeed:
    return DecoderSeed(generate.request_id, completion_options(request), False)


def final_finish_reason(engine_reason: str | None, decoder: ChoiceDecoder) -> str:
    """A stop string ends as "stop"; a stop that produced tool calls is "tool_calls"."""
    reason = "stop" if decoder.stopped else engine_reason or "stop"
    if reason == "stop" and decoder.num_tool_calls:
        return "tool_calls"
    return reason


def feed(renderer: Renderer, state: DecoderSeed | ChoiceDecoder, piece: DerenderPiece) -> DerenderedPiece:
    """Decode one piece of a choice; the returned state is the choice's decoder."""
    if isinstance(state, DecoderSeed):
        decoder = ChoiceDecoder(
            renderer.tokenizer,
            state.options,
            starts_in_reasoning=state.starts_in_reasoning,
            tool_id_salt=f"{state.request_id}:{piece.index}",
        )
    else:
        decoder = state
    delta = decoder.feed(piece.token_ids, piece.logprobs)
    if not (decoder.stopped or piece.final or piece.finish_reason is not None):
        return DerenderedPiece(decoder, delta, None, False)
    delta = merge_deltas(delta, decoder.finish())
    return DerenderedPiece(decoder, delta, final_finish_reason(piece.finish_reason, decoder), decoder.stopped)


class SignedStates:
    """Seeds and decoders as signed strings, for the render tier's HTTP way back."""

    def __init__(self, renderer: Renderer, codec: StreamStateCodec) -> None:
        self.renderer = renderer
        self.codec = codec

    def seed(self, seed: DecoderSeed) -> str:
        options = _options_to_wire(seed.options)
        return self.codec.encode({"rid": seed.request_id, "opt": options, "sir": seed.starts_in_reasoning})

    def decode(self, token: str, index: int) -> DecoderSeed | ChoiceDecoder:
        try:
            state = self.codec.decode(token)
        except StreamStateError as exc:  # forged, or signed by a replica with another key
            raise InvalidRequestError(str(exc), f"pieces[{index}].state") from exc
        try:
            options = DecodeOptions(**{**state["opt"], "stop": tuple(state["opt"]["stop"])})
            if state.get("dec") is None:
                return DecoderSeed(str(state["rid"]), options, bool(state["sir"]))
            return ChoiceDecoder.from_state(self.renderer.tokenizer, options, state["dec"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError("not a derender state", f"pieces[{index}].state") from exc

    def encode(self, decoder: ChoiceDecoder) -> str:
        return self.codec.encode({"opt": _options_to_wire(decoder.options), "dec": decoder.state()})


def _options_to_wire(options: DecodeOptions) -> dict[str, Any]:
    return {**asdict(options), "stop": list(options.stop)}
