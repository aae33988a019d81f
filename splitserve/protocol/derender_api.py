"""Wire shapes of the derender endpoint: generate responses/chunks coming back from an
engine (`/inference/v1/generate`, vLLM's field names) and the derender request bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitserve.protocol.openai_api import ChatCompletionRequest


class GenerateLogprob(BaseModel):
    model_config = ConfigDict(extra="ignore")
    token_id: int = Field(ge=0)
    logprob: float
    rank: int | None = None


class GenerateLogprobEntry(GenerateLogprob):
    top_logprobs: list[GenerateLogprob] = Field(default_factory=list)


class GenerateLogprobs(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: list[GenerateLogprobEntry] | None = None


class GenerateChoice(BaseModel):
    """One choice of a generate response or stream chunk (`/inference/v1/generate`)."""

    model_config = ConfigDict(extra="ignore")
    index: int = Field(default=0, ge=0)
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    logprobs: GenerateLogprobs | None = None

    def all_token_ids(self) -> list[int]:
        """Every token ID the choice mentions, sampled or candidate."""
        ids = list(self.token_ids)
        for entry in (self.logprobs.content or []) if self.logprobs else []:
            ids.append(entry.token_id)
            ids.extend(candidate.token_id for candidate in entry.top_logprobs)
        return ids

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token IDs must be non-negative")
        return value


class GenerateUsage(BaseModel):
    """The engine's usage counts: typed, so a malformed one is a 400 naming the field."""

    model_config = ConfigDict(extra="allow")
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    total_tokens: int | None = Field(default=None, ge=0)


class GenerateOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str | None = Field(default=None, max_length=256)
    choices: list[GenerateChoice] = Field(default_factory=list)
    usage: GenerateUsage | None = None
    prompt_token_ids: list[int] | None = None


class DerenderChatRequest(BaseModel):
    """`/v1/chat/completions/derender`, non-streaming: a whole generate response."""

    model_config = ConfigDict(extra="ignore")
    stream: Literal[False] = False
    model: str | None = None
    generate_response: GenerateOutput
    chat_request: ChatCompletionRequest | None = None
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)


class DerenderChatStreamRequest(BaseModel):
    """`/v1/chat/completions/derender`, streaming: one generate chunk plus the signed state
    the previous call returned (null on the first chunk)."""

    model_config = ConfigDict(extra="ignore")
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateOutput
    stream_state: str | None = None
    chat_request: ChatCompletionRequest | None = None
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)


MAX_PIECES = 1024


class DerenderPieceBody(BaseModel):
    """One choice's new engine output (`FrontendClient.derender` over HTTP)."""

    model_config = ConfigDict(extra="forbid")
    # signed: from render (`?derender_state=true`) or the previous derender; null: this
    # piece continues the one before it in the same call
    state: str | None = None
    index: int = Field(default=0, ge=0)
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[GenerateLogprobEntry] | None = None
    finish_reason: str | None = None
    final: bool = False

    def all_token_ids(self) -> list[int]:
        ids = list(self.token_ids)
        for entry in self.logprobs or []:
            ids.append(entry.token_id)
            ids.extend(candidate.token_id for candidate in entry.top_logprobs)
        return ids


class DerenderPiecesRequest(BaseModel):
    """`POST /v1/derender/pieces`: several choices' new tokens in one call."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    pieces: list[DerenderPieceBody] = Field(max_length=MAX_PIECES)
