"""Per-request P/D decisions: which prompts go through the prefill pool at all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TransferMode = Literal["push", "pull"]


@dataclass(frozen=True)
class PDPolicy:
    # A prompt shorter than this is prefilled on the decode worker: its prefill is cheap,
    # and a handoff would cost more than the interference it avoids.
    min_prefill_tokens: int = 64
    mode: TransferMode = "push"
    reserve_timeout_s: float = 30.0
    # push: prefill pulls the leading blocks decode already holds (by block hash) instead
    # of computing them; off, KV moves one way only (prefill recomputes them)
    bidirectional: bool = True

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0:
            raise ValueError("min_prefill_tokens must be >= 0")
        if self.mode not in ("push", "pull"):
            raise ValueError(f"unknown transfer mode {self.mode!r} (push or pull)")

    def use_prefill_pool(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Whether the uncached part of the prompt is worth a prefill worker."""
        return num_prompt_tokens - num_cached_tokens >= self.min_prefill_tokens
