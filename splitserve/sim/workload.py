"""Workloads: arrivals (Poisson, bursty gamma), prompt/output lengths, multi-turn sessions,
and traces replayed from CSV or JSONL.

A workload is a set of arrays, one entry per request. Open-loop requests have an arrival
time; a multi-turn follow-up instead names the request it follows (`after`) and a think
time, and the simulator releases it when its predecessor's last token arrives.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitserve.goodput import Lengths, arrival_times


class WorkloadError(ValueError):
    """Bad workload input (lengths, rates, trace files)."""


@dataclass(frozen=True)
class Workload:
    arrival: np.ndarray  # s; ignored for follow-ups (after >= 0)
    prompt: np.ndarray  # prompt tokens (whole conversation so far for a follow-up)
    output: np.ndarray  # output tokens
    after: np.ndarray  # index of the request this one follows, -1 if open-loop
    think_s: np.ndarray  # delay after the predecessor's last token
    prefix: np.ndarray  # leading prompt tokens identical to the predecessor's prompt+output
    prev_prompt: np.ndarray  # the predecessor's prompt length (what a one-way prefill cached)
    session: np.ndarray  # session id (-1: none)

    def __len__(self) -> int:
        return len(self.prompt)

    @staticmethod
    def open_loop(arrival, prompt, output) -> Workload:
        n = len(arrival)
        zeros = np.zeros(n, dtype=np.int64)
        return Workload(
            arrival=np.asarray(arrival, dtype=float),
            prompt=np.asarray(prompt, dtype=np.int64),
            output=np.asarray(output, dtype=np.int64),
            after=np.full(n, -1, dtype=np.int64),
            think_s=np.zeros(n),
            prefix=zeros,
            prev_prompt=zeros.copy(),
            session=np.full(n, -1, dtype=np.int64),
        )


def lengths(spec: str | int, n: int, rng: random.Random) -> np.ndarray:
    """`n` draws of a length distribution (splitserve.goodput.Lengths forms)."""
    try:
        dist = Lengths.parse(spec)
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    return np.array([dist.sample(rng) for _ in range(n)], dtype=np.int64)


def synthetic(
    rate: float,
    n: int,
    prompt: str | int = 8192,
    output: str | int = 256,
    seed: int = 0,
    burstiness: float = 1.0,
) -> Workload:
    """`n` open-loop requests. Arrivals are the stream `random.Random(seed)` draws (the seed's
    own for a Poisson process; `burstiness` is the gamma shape, vLLM's convention); lengths
    come from streams of their own, so a longer run of the same seed extends the same requests."""
    try:
        arrival = arrival_times(rate, n, seed, "poisson" if burstiness == 1.0 else "gamma", burstiness)
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    prompts = lengths(prompt, n, random.Random(f"prompt-{seed}"))
    return Workload.open_loop(arrival, prompts, lengths(output, n, random.Random(f"output-{seed}")))


def sessions(
    rate: float,
    n_sessions: int,
    turns: int = 6,
    first_prompt: int = 4000,
    message: int = 400,
    answer: int = 600,
    think_s: float = 5.0,
    stripped: int = 0,
    seed: int = 0,
) -> Workload:
    """Multi-turn chats: each turn resends the whole conversation plus a new message.
    `stripped` tokens of every answer (a reasoning trace the chat template drops) are not
    resent, so reuse by block hash stops where they were: at the end of the previous prompt."""
    if turns < 1 or n_sessions < 1:
        raise WorkloadError("sessions and turns must be >= 1")
    if not 0 <= stripped < answer:
        raise WorkloadError("stripped must be in [0, answer)")
    try:
        starts = arrival_times(rate, n_sessions, seed)
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    cols: dict[str, list] = {
        k: [] for k in ("arrival", "prompt", "output", "after", "think", "prefix", "prev")
    }
    for s, start in enumerate(starts):
        history, prev_prompt = 0, 0
        for turn in range(turns):
            prompt = first_prompt if turn == 0 else history + message
            cols["arrival"].append(start if turn == 0 else 0.0)
            cols["prompt"].append(prompt)
            cols["output"].append(answer)
            cols["after"].append(-1 if turn == 0 else len(cols["prompt"]) - 2)
            cols["think"].append(0.0 if turn == 0 else think_s)
            reusable = 0 if turn == 0 else (prev_prompt if stripped else prev_prompt + answer)
            cols["prefix"].append(reusable)
            cols["prev"].append(prev_prompt)
            prev_prompt = prompt
            history = prompt + answer - stripped
        del s
    n = len(cols["prompt"])
    return Workload(
        arrival=np.array(cols["arrival"], dtype=float),
        prompt=np.array(cols["prompt"], dtype=np.int64),
        output=np.array(cols["output"], dtype=np.int64),
        after=np.array(cols["after"], dtype=np.int64),
        think_s=np.array(cols["think"]),
        prefix=np.array(cols["prefix"], dtype=np.int64),
        prev_prompt=np.array(cols["prev"], dtype=np.int64),
        session=np.repeat(np.arange(n_sessions), turns)[:n],
    )


_TIME = ("arrival_s", "timestamp", "time", "arrival")
_PROMPT = ("prompt_tokens", "input_length", "input_tokens", "prompt_len", "isl")
_OUTPUT = ("output_tokens", "output_length", "max_tokens", "output_len", "osl")


def _field(row: dict, names: tuple[str, ...], where: str) -> float:
    for name in names:
        if name in row and row[name] not in (None, ""):
            try:
                return float(row[name])
            except (TypeError, ValueError) as exc:
                raise WorkloadError(f"{where}: {name}={row[name]!r} is not a number") from exc
    raise WorkloadError(f"{where}: needs one of {', '.join(names)}")


def load_trace(path: str, time_scale: float = 1.0) -> Workload:
    """Replay a trace: CSV with a header, or JSONL, one request per row/line. Columns:
    arrival time (arrival_s | timestamp; ms if the column is timestamp_ms), prompt tokens
    (prompt_tokens | input_length), output tokens (output_tokens | output_length), and an
    optional session_id: consecutive requests of a session reuse the previous one's prefix."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    rows: list[dict] = []
    try:
        if p.suffix in (".jsonl", ".json"):
            for i, line in enumerate(p.read_text().splitlines()):
                if line.strip():
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise WorkloadError(f"{path}:{i + 1}: expected a JSON object")
                    rows.append(obj)
        else:
            with open(p, newline="") as f:
                rows = list(csv.DictReader(f))
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: bad JSON line ({exc})") from exc
    if not rows:
        raise WorkloadError(f"{path}: empty trace")
    arrival, prompt, output, session = [], [], [], []
    for i, row in enumerate(rows):
        where = f"{path}:{i + 1}"
        if "timestamp_ms" in row:
            arrival.append(_field(row, ("timestamp_ms",), where) / 1000.0)
        else:
            arrival.append(_field(row, _TIME, where))
        prompt.append(int(_field(row, _PROMPT, where)))
        output.append(int(_field(row, _OUTPUT, where)))
        sid = row.get("session_id", row.get("conversation_id"))
        session.append(hash(str(sid)) & 0x7FFFFFFF if sid not in (None, "") else -1)
    if min(prompt) < 1 or min(output) < 1:
        raise WorkloadError(f"{path}: token counts must be >= 1")
    t = np.array(arrival, dtype=float)
    t = (t - t.min()) * time_scale
    order = np.argsort(t, kind="stable")
    wl = Workload.open_loop(t[order], np.array(prompt)[order], np.array(output)[order])
    sess = np.array(session, dtype=np.int64)[order]
    last: dict[int, int] = {}
    for i, s in enumerate(sess):
        if s >= 0 and s in last:
            j = last[s]
            wl.prefix[i] = min(int(wl.prompt[j] + wl.output[j]), int(wl.prompt[i]) - 1)
            wl.prev_prompt[i] = wl.prompt[j]
        if s >= 0:
            last[int(s)] = i
    wl.session[:] = sess
    return wl


_INPUT = (*_PROMPT, "input_tokens")


def _words(text: object) -> int:
    # a `bench` dataset without a tokenizer counts a token per word (bench's PromptFactory)
    return len(str(text).split())


def _pair_of_dataset_line(row: dict, where: str) -> tuple[int, int]:
    """A `splitserve bench --dataset` line (prompt / messages / conversations): the prompt's
    words stand for its tokens; the output is max_tokens or the recorded answer's words."""
    if "prompt" in row:
        turns = [("user", row["prompt"])]
    elif "messages" in row:
        turns = [(m.get("role"), m.get("content")) for m in row["messages"]]
    elif "conversations" in row:
        turns = [("assistant" if m.get("from") in ("gpt", "assistant") else "user", m.get("value"))
                 for m in row["conversations"]]  # fmt: skip
    else:
        raise WorkloadError(
            f"{where}: needs token counts (prompt_tokens, output_tokens) or a bench dataset line"
        )
    answer = turns.pop()[1] if len(turns) > 1 and turns[-1][0] == "assistant" else None
    output = row.get("max_tokens") or (_words(answer) if answer is not None else None)
    if output is None:
        raise WorkloadError(f"{where}: a dataset line needs max_tokens or a recorded answer")
    return sum(_words(text) for _, text in turns), int(output)


def load_lengths(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Observed (prompt, output) token counts, one pair per request: JSONL of counts
    (prompt_tokens | input_length | input_tokens, output_tokens | output_length | max_tokens),
    a `splitserve bench` dataset (JSONL of chats), or a `bench --json` results file (its
    measured requests, warm-ups and errors left out)."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"--lengths {path}: no such file")
    text = p.read_text()
    rows: list[dict] = []
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and "levels" in whole:
        for level in whole["levels"]:
            rows += [r for r in level.get("requests", []) if not r.get("warmup") and not r.get("error")]
    else:
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise WorkloadError(f"{path}:{i + 1}: bad JSON line ({exc})") from None
                if not isinstance(obj, dict):
                    raise WorkloadError(f"{path}:{i + 1}: expected a JSON object")
                rows.append(obj)
    if not rows:
        raise WorkloadError(f"--lengths {path}: no requests in it")
    prompts, outputs = [], []
    for i, row in enumerate(rows):
        where = f"{path}:{i + 1}"
        if any(k in row for k in _INPUT):
            prompt, output = int(_field(row, _INPUT, where)), int(_field(row, _OUTPUT, where))
        else:
            prompt, output = _pair_of_dataset_line(row, where)
        if prompt < 1 or output < 1:
            raise WorkloadError(f"{where}: token counts must be >= 1")
        prompts.append(prompt)
        outputs.append(output)
    return np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64)


def observed(
    rate: float, n: int, pairs: tuple[np.ndarray, np.ndarray], seed: int = 0, burstiness: float = 1.0
) -> Workload:
    """`n` open-loop requests at `rate` (the arrivals `synthetic` draws), each a (prompt,
    output) pair drawn with replacement from observed requests: the joint distribution, not
    its means."""
    try:
        arrival = arrival_times(rate, n, seed, "poisson" if burstiness == 1.0 else "gamma", burstiness)
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    rng = random.Random(f"lengths-{seed}")
    picks = [rng.randrange(len(pairs[0])) for _ in range(n)]
    return Workload.open_loop(arrival, pairs[0][picks], pairs[1][picks])
