"""What the engine's parts hand back: the model runner's sampled tokens, and the
engine's per-step request outputs and engine-wide statistics."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.engine.request import Request


class SampledToken(NamedTuple):
    request: Request
    token_id: int
    logprobs: dict | None


class ModelRunnerOutput(NamedTuple):
    """One step's sampled tokens: one per request whose last scheduled token is the
    request's last (a prefill chunk short of the prompt's end samples nothing)."""

    sampled: list[SampledToken]


class RequestOutput(NamedTuple):
    """The tokens a request produced in one step (a delta, not the history).

    `new_logprobs`, when the request asked for logprobs, holds one entry per new token:
    `{"token_id": int, "logprob": float, "top_logprobs": [[token_id, logprob], ...]}`.
    `metrics` times are `time.monotonic()` seconds: arrival_time, first_scheduled_time,
    first_token_time, last_token_time, finished_time (None until they happen).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict | None
    metrics: dict


class StepShape(NamedTuple):
    """What one step computed, as the simulator's step model prices it: the sequences that
    decoded one token, the tokens those attended (their contexts, summed), and each prompt
    chunk's (tokens, tokens computed before it)."""

    decodes: int = 0
    decode_context: int = 0
    chunks: tuple[tuple[int, int], ...] = ()


class EngineStats(NamedTuple):
    num_running: int
    num_waiting: int  # includes requests waiting for remote KV
    kv_usage: float  # fraction of blocks in use, 0..1
    num_blocks_total: int
    num_blocks_free: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    last_step_time_s: float
    last_step_tokens: int
    # the router's load terms: prompt tokens still to compute (waiting and prefilling
    # requests, past the prefix-cache hit; not those waiting for remote KV) and blocks
    # held by decoding requests
    num_waiting_prefill_tokens: int
    num_running_decode_blocks: int
    num_borrowed_cpu_steps: int = 0  # steps run on an idle lender's CPUs too (cpu_lending.py)
    last_step_borrowed: bool = False  # the last step among them: its time is not this engine's own
    num_threads: int = 0  # threads a step runs on (its own CPUs'; `sim calibrate` keys profiles by it)
    step_thread_cpu_s: float = 0.0  # the engine thread's CPU time in steps, all steps so far
    step_thread_wait_s: float = 0.0  # its time waiting runnable for a core in steps (Linux)
    long_prefill_token_threshold: int = 0  # a prompt's tokens a step beside decodes (0: no cap)
    recent_steps: tuple[tuple[int, float], ...] = ()  # the last steps' (tokens, seconds), oldest first
    last_step_shape: StepShape = StepShape()  # what the last step computed (`sim retime` prices it)
