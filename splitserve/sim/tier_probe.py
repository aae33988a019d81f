"""Measure the tiers around the engine for `sim calibrate --engine URL --out FILE`, through
their public HTTP APIs (standard library only):

- `--render URL`: the render tier's time per request, as the proxy waits for it: POST
  /v1/completions/render of prompts of several lengths, wall time on the client (HTTP
  included: the proxy pays the same hop), the fastest of `repeats` kept; a line fitted to
  (prompt tokens, seconds) gives the cost per request and per prompt token.
- `--proxy URL`: `up`'s proxy and its render tier, which share the engines' cores. The
  delay: the client's time to a one-token answer of a short prompt beyond its prefill
  step (the step model's) and the render tier's time. The CPU: both tiers'
  `process_cpu_seconds_total` (their /metrics) around four loads of known shape (short
  prompts of one token and of 48 at 8 concurrent and at 1, and long prompts that a
  prefill worker takes where there is one), less their idle background, fitted to
  requests, remote requests, the decode workers' steps (their step counts) and tokens.
  Each one-thread engine's process CPU beyond its engine thread's in steps (its API, the
  KV it pushes or takes in) is fitted the same way, apart, by role: it runs on that
  engine's own core, not on every core. Prefill and delay are timed against the steps
  measured at the stack's own workers' thread counts (`--engine` twice), where the
  profile has them.
- `--pd URL`: a P/D proxy's handoff. First tokens of several prompt lengths, one request
  at a time: short ones first, which stay on the decode worker (as many as the proxy's
  first-token window, router/pd_costs.FIXED_WINDOW, so that its own cost decision sends
  the long ones remote), then long ones through the prefill worker, the path each took
  read from the proxy's request counters around it. A local first token less the decode
  worker's step (its step-time counter), and a remote one less the prefill worker's step
  for that prompt alone (timed on the worker) and the decode worker's first step (its step
  model), the smallest of each kept: the remote less the local is the handoff, and a line
  through it by KV bytes gives the fixed cost and the cost per byte. (The proxy's own
  figure, `GET /workers`, is a difference of medians over whatever ran; calibrations that
  read it got 0 to 94 ms on the same stack.)
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from splitserve.router.pd_costs import FIXED_WINDOW
from splitserve.sim.calibrate import CalibrationError
from splitserve.sim.engine_probe import STEP_SECONDS, EngineProbe, http_error, run_together
from splitserve.sim.path_latency import fit_line
from splitserve.sim.profile import CpuCosts
from splitserve.sim.step_model import StepModel

_WORDS = ("alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike")


def _post(url: str, body: dict | None, timeout_s: float) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:200]
        raise CalibrationError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CalibrationError(f"{url}: cannot reach it or not JSON ({exc})") from None


def measure_render(
    url: str, words: Sequence[int] = (16, 128, 512, 1024), repeats: int = 3, timeout_s: float = 60.0
) -> CpuCosts:
    base = url.rstrip("/") + "/v1/completions/render"
    rng = random.Random(0)
    _post(base, {"prompt": "warm up"}, timeout_s)
    tokens, seconds = [], []
    for n in words:
        best, count = float("inf"), 0
        for _ in range(repeats):
            text = " ".join(rng.choice(_WORDS) for _ in range(n))
            start = time.perf_counter()
            out = _post(base, {"prompt": text}, timeout_s)
            best = min(best, time.perf_counter() - start)
            try:
                count = len(out[0]["token_ids"])  # type: ignore[index]
            except (KeyError, IndexError, TypeError):
                raise CalibrationError(f"{base}: the answer carries no token_ids") from None
        tokens.append(count)
        seconds.append(best)
    per_request, per_token = fit_line(np.array(tokens, dtype=float), np.array(seconds, dtype=float))
    return CpuCosts(per_request, per_token)


class PathCpu(NamedTuple):
    """CPU seconds of one part of the serving path, fitted to the load's shape."""

    per_request: float  # per request on the local path
    per_remote_request: float  # more per request sent through a prefill worker
    per_step: float  # per decode-worker step that streams
    per_token: float  # per streamed token


class TierCosts(NamedTuple):
    """The serving path around the engines (`up`'s proxy and render tier) and the engines'
    own processes beyond their engine threads (measured on one-thread engines only)."""

    delay_s: float  # a request's wait in the proxy beyond the render call, before the engine
    tiers: PathCpu  # the proxy and the render tier: on every core
    decode_engine: PathCpu  # a decode worker's own process: on its cores
    prefill_engine_s_per_request: float  # a prefill worker's own process, per request: on its cores


class _Load(NamedTuple):
    prompt_tokens: int
    max_tokens: int
    requests: int
    concurrency: int


class _Reading(NamedTuple):
    cpu_s: np.ndarray  # proxy + render tiers, decode engines' own, prefill engines' own
    decode_steps: float  # steps of the workers that stream (decode role)
    remote: float  # requests through a prefill worker
    at: float  # perf_counter


# Short prompts stay on the decode worker; long ones go through a prefill worker where one
# exists. One token each prices a request; 48 at 8 and at 1 concurrent price a token and a
# step (a lone stream pays a step per token, eight share one).
_LOADS = (_Load(16, 1, 48, 8), _Load(16, 48, 24, 8), _Load(16, 48, 12, 1), _Load(256, 1, 48, 8))


def _get_text(url: str, headers: dict[str, str], timeout_s: float) -> str:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise http_error(url, exc) from None
    except (urllib.error.URLError, OSError) as exc:
        raise CalibrationError(f"{url}: cannot reach it ({exc})") from None


def _metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus sample's values (every label set unless `labels` narrows it)."""
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and labels in key:
            total += float(value)
    return total


def remote_requests(proxy_metrics: str) -> float:
    """Requests the proxy has sent through a prefill worker so far (any P/D path)."""
    return _metric(proxy_metrics, "splitserve_proxy_requests_total", 'path="pd_')


def proxy_state(base: str, timeout_s: float) -> dict:
    """The proxy's `GET /workers` answer ({} if it is not an object)."""
    state = _post(base + "/workers", None, timeout_s)
    return state if isinstance(state, dict) else {}


def measure_tiers(
    url: str,
    by_threads: Mapping[int, StepModel],
    fallback: StepModel,
    render: CpuCosts | None,
    timeout_s: float = 120.0,
) -> TierCosts:
    """What `up`'s proxy and render tier cost: the delay a request meets before the engine,
    and the CPU they take per request, per remote request, per streaming step and per token,
    read from their `process_cpu_seconds_total` around loads of known shape."""
    from splitserve.runtime.access import internal_headers

    base = url.rstrip("/")
    state = proxy_state(base, timeout_s)
    if "render" not in state:
        raise CalibrationError(f"{base}: --proxy must be `up`'s proxy (its /workers lists the render tier)")
    workers = state.get("workers") or []
    streaming = [w["url"] for w in workers if w.get("role") == "decode"]
    has_prefill = any(w.get("role") == "prefill" for w in workers)
    internal = internal_headers()

    # an engine of one thread spends its process CPU beyond its engine thread's in steps on
    # its API (each request's stream, the KV it pushes or takes in); of a wider engine that
    # figure holds its torch threads too, so it is not measured (a prefill engine that
    # borrows an idle decode's CPUs counts their threads' CPU as well: calibrate a stack
    # started with --no-lend-idle-cpus)
    threads = {w["url"]: EngineProbe(w["url"], timeout_s).threads() for w in workers}
    single = [worker_url for worker_url, count in threads.items() if count == 1]

    def read() -> _Reading:
        proxy = _get_text(base + "/metrics", {}, timeout_s)
        cpu = np.zeros(3)
        cpu[0] = _metric(proxy, "process_cpu_seconds_total")
        cpu[0] += sum(
            _metric(_get_text(r + "/metrics", internal, timeout_s), "process_cpu_seconds_total")
            for r in state["render"]
        )
        steps_done = 0.0
        for worker in workers:
            text = _get_text(worker["url"] + "/metrics", internal, timeout_s)
            if worker["url"] in streaming:
                steps_done += _metric(text, "splitserve_step_time_seconds_count")
            if worker["url"] in single:
                own = _metric(text, "process_cpu_seconds_total")
                own -= _metric(text, "splitserve_step_thread_cpu_seconds_total")
                cpu[1 if worker["url"] in streaming else 2] += own
        return _Reading(cpu, steps_done, remote_requests(proxy), time.perf_counter())

    rng = random.Random(2)
    completions = base + "/v1/completions"

    def one(prompt_tokens: int, max_tokens: int) -> None:
        body = {
            "prompt": [rng.randrange(10, 250) for _ in range(prompt_tokens)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        _post(completions, body, timeout_s)

    one(16, 2)  # warm-up
    delay = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        one(16, 1)
        delay = min(delay, time.perf_counter() - start)
    before_engine = render.delay_s(16) if render is not None else 0.0
    # the decode worker's steps: the model measured at its thread count
    local = by_threads.get(threads[streaming[0]], fallback) if streaming else fallback
    delay = max(0.0, delay - local.prefill_s(16) - before_engine)

    idle = read()
    time.sleep(1.0)  # the tiers' background (health checks, event feeds) per second
    after_idle = read()
    background = (after_idle.cpu_s - idle.cpu_s) / (after_idle.at - idle.at)
    rows, cpu = [], []
    for load in _LOADS:
        if load.prompt_tokens > 16 and not has_prefill:
            continue
        before = read()
        rounds, extra = divmod(load.requests, load.concurrency)
        for copies in [load.concurrency] * rounds + ([extra] if extra else []):
            run_together(lambda load=load: one(load.prompt_tokens, load.max_tokens), copies)
        after = read()
        remote = after.remote - before.remote
        steps_done = after.decode_steps - before.decode_steps
        rows.append([load.requests - remote, remote, steps_done, load.requests * load.max_tokens])
        cpu.append(after.cpu_s - before.cpu_s - background * (after.at - before.at))
    matrix = np.array(rows, dtype=float)
    used = [0, 2, 3] + ([1] if matrix[:, 1].any() else [])
    fitted, *_ = np.linalg.lstsq(matrix[:, used], np.array(cpu), rcond=None)

    def path(part: int) -> PathCpu:
        per = dict(zip(used, (max(0.0, float(v)) for v in fitted[:, part]), strict=True))
        local = per[0]
        return PathCpu(local, max(0.0, per.get(1, local) - local), per[2], per[3])

    # a prefill worker's own CPU is all its requests' (it prefills no local request and
    # streams nothing)
    prefill = path(2)
    return TierCosts(delay, path(0), path(1), prefill.per_request + prefill.per_remote_request)


def handoff_costs(
    local_excess_s: float, remote_excess_s: Mapping[int, float], kv_bytes_per_token: int
) -> tuple[float, float]:
    """(fixed seconds, seconds per KV byte) of the P/D handoff, from first tokens timed
    alone, each less the engine steps the simulator runs for it: `local_excess_s` of a
    prompt the decode worker prefilled, `remote_excess_s` by prompt tokens through the
    prefill worker. The remote path spends what the local one does beyond its steps (the
    hops, the render tier) plus the handoff; a line through the remote excesses by KV bytes
    gives its fixed part and its part per byte."""
    sizes = sorted(remote_excess_s)
    sent = np.array([n * kv_bytes_per_token for n in sizes], dtype=float)
    intercept, per_byte = fit_line(sent, np.array([remote_excess_s[n] for n in sizes], dtype=float))
    return max(0.0, intercept - local_excess_s), per_byte


def measure_handoff(
    url: str,
    by_threads: Mapping[int, StepModel],
    fallback: StepModel,
    kv_bytes_per_token: int,
    prompt_tokens: Sequence[int] = (256, 1024, 2048),
    repeats: int = 3,
    timeout_s: float = 120.0,
) -> tuple[float, float]:
    """(fixed seconds, seconds per KV byte) of the P/D handoff: `handoff_costs` of the
    smallest excess of each prompt size on each path, one request at a time, the path each
    took read from the proxy's counters around it. A local first token is less the decode
    worker's step (its step-time counter around it). A remote one is less the steps the
    simulator runs for it: the prefill worker's step for that prompt alone (timed on the
    worker itself, not fitted: a fitted 2,048-token step is off by tens of ms) and the
    decode worker's first step at batch 1 (its step model). What the two workers' steps
    take beyond those within a P/D request (the KV pushed as the prefill runs, taken in
    before the first decode step) is the handoff's."""
    base = url.rstrip("/")
    workers = proxy_state(base, timeout_s).get("workers") or []
    probes = {
        role: [EngineProbe(w["url"], timeout_s) for w in workers if w.get("role") == role]
        for role in ("prefill", "decode")
    }
    if not probes["prefill"] or not probes["decode"]:
        raise CalibrationError(f"{base}: --pd needs a P/D proxy (its /workers lists prefill and decode)")
    decode = by_threads.get(probes["decode"][0].threads(), fallback)
    rng = random.Random(1)

    def reading() -> tuple[float, float]:
        """Requests sent remote so far, and the decode workers' step seconds."""
        remote = remote_requests(_get_text(base + "/metrics", {}, timeout_s))
        return remote, sum(p.step_counters()[STEP_SECONDS] for p in probes["decode"])

    def first_token(n: int) -> tuple[float, float, bool]:
        """One first token's time, the decode workers' step time in it, and whether it
        went remote."""
        body = {"prompt": [rng.randrange(10, 250) for _ in range(n)], "max_tokens": 1, "temperature": 0}
        before = reading()
        start = time.perf_counter()
        _post(base + "/v1/completions", body, timeout_s)
        took = time.perf_counter() - start
        after = reading()
        return took, after[1] - before[1], after[0] > before[0]

    # short prompts first: they stay on decode, and the proxy's own first-token window
    # (router/pd_costs.FIXED_WINDOW) fills with them, so that its cost decision sends the
    # long ones to the prefill worker
    local_tokens, local_s = 16, float("inf")
    for _ in range(FIXED_WINDOW):
        took, decode_steps_s, remote = first_token(local_tokens)
        if not remote:
            local_s = min(local_s, took - decode_steps_s)
    remote_s: dict[int, float] = {}
    per_size = max(repeats, -(-FIXED_WINDOW // len(prompt_tokens)))
    alone = probes["prefill"][0]
    for n in prompt_tokens:
        alone_steps = [alone.prefill_step_s(n) for _ in range(repeats)]
        prefill_s = min((t for t in alone_steps if t is not None), default=None)
        if prefill_s is None:
            raise CalibrationError(f"{alone.url}: a {n}-token prompt alone took more than one step")
        for _ in range(per_size):
            took, _, remote = first_token(n)
            if remote:
                beyond = took - prefill_s - float(decode.decode_s(1, n))
                remote_s[n] = min(remote_s.get(n, float("inf")), beyond)
    if local_s == float("inf") or len(remote_s) < 2:
        raise CalibrationError(
            f"{base}: the handoff needs {local_tokens}-token prompts kept on the decode worker and long ones "
            f"of two sizes or more sent to the prefill worker (remote: {sorted(remote_s) or 'none'}): "
            "is it a P/D proxy deciding on cost?"
        )
    return handoff_costs(local_s, remote_s, kv_bytes_per_token)
