"""Measure step times on a live splitserve engine (`splitserve engine`, any engine speaking
its API) for `sim calibrate --engine URL`. Standard library only: HTTP with urllib.

- Prefill: one request of N fresh tokens (`max_tokens: 1`) on an idle engine. Its step
  time is what the engine's `/metrics` step-time histogram gained (`_sum`), kept only when
  exactly one step ran (N within the engine's token budget).
- Decode: B requests of C fresh tokens sent at once, `max_tokens: K` each, for each B and
  C. A request's engine-side `mean_itl_ms` (first to last token, engine clock, no HTTP in
  it) is the mean step time of the decode batch it rode in; the sample is the median over
  the B requests, at batch B and mean context C + K / 2. (The first request to arrive
  prefills alone and finishes a step early, so the others' last step runs at batch B - 1:
  a bias of about one step in K, which the median request carries.)
- Mixed: B requests decoding (all B in every step, per `/inference/v1/stats`), then a
  prompt of N fresh tokens (`max_tokens: 1`) sent: it prefills in one step beside them,
  whose time the engine's stats list among its recent steps (`recent_steps`: tokens and
  seconds), the step of B + N tokens. (A difference of the step-time counters around it
  instead carried whatever else slowed the steps while the prompt arrived: calibrations
  of one engine gave 5 to 16 ms beyond its tokens.)

Each shape is measured `repeats` times and the fastest kept: a shared machine only ever
adds time. Token IDs are drawn at random from a small range so every prompt is new to the
engine's prefix cache.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from splitserve.runtime.access import INTERNAL_TOKEN_ENV, internal_headers
from splitserve.sim.calibrate import CalibrationError, Sample

POLL_S = 0.002  # between reads of a live engine's stats while a batch is being admitted
STEPS, STEP_SECONDS = "splitserve_step_time_seconds_count", "splitserve_step_time_seconds_sum"

_METRIC = re.compile(r"^(splitserve_step_time_seconds_(?:sum|count))\s+(\S+)$")


class EngineProbe:
    def __init__(self, url: str, timeout_s: float = 300.0, seed: int = 0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _call(self, path: str, body: dict | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        # an engine of a deployment answers its internal token only ($SPLITSERVE_INTERNAL_TOKEN)
        headers = {**internal_headers(), **({"Content-Type": "application/json"} if data else {})}
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            raise http_error(self.url + path, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise CalibrationError(f"{self.url}{path}: cannot reach the engine ({exc})") from None

    def health(self) -> None:
        self._call("/health")

    def threads(self) -> int:
        """The threads the engine's steps run on."""
        threads = self.stats().get("num_threads")
        if not isinstance(threads, int) or threads < 1:
            raise CalibrationError(f"{self.url}/inference/v1/stats reports no num_threads")
        return threads

    def step_counters(self) -> dict[str, float]:
        found = {}
        for line in self._call("/metrics").decode().splitlines():
            m = _METRIC.match(line.strip())
            if m:
                found[m.group(1)] = float(m.group(2))
        if len(found) < 2:
            raise CalibrationError(f"{self.url}/metrics has no splitserve step-time histogram")
        return found

    def _tokens(self, n: int) -> list[int]:
        with self._lock:
            return [self._rng.randrange(10, 250) for _ in range(n)]

    def generate(self, prompt_tokens: int, max_tokens: int) -> dict:
        body = {
            "token_ids": self._tokens(prompt_tokens),
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        return json.loads(self._call("/inference/v1/generate", body))

    def prefill_step_s(self, tokens: int) -> float | None:
        """One prompt's prefill step time; None if it took more than one step."""
        before = self.step_counters()
        self.generate(tokens, 1)
        after = self.step_counters()
        steps = after[STEPS] - before[STEPS]
        if steps != 1:
            return None
        return after[STEP_SECONDS] - before[STEP_SECONDS]

    def api_latency_s(self, tokens: int = 16, repeats: int = 3) -> float | None:
        """A request's time outside the engine's steps (HTTP, JSON, its way in and out): the
        wall time of a one-token answer on an idle engine less the one step that computed
        it, as the engine's stats time it; the fastest of `repeats`. None if the engine's
        stats list no steps, or no repeat ran in one step."""
        best = None
        for _ in range(repeats):
            start = time.perf_counter()
            self.generate(tokens, 1)
            wall = time.perf_counter() - start
            recent = self.stats().get("recent_steps") or []
            if recent and int(recent[-1][0]) == tokens:
                outside = max(0.0, wall - float(recent[-1][1]))
                best = outside if best is None else min(best, outside)
        return best

    def stats(self) -> dict:
        stats = json.loads(self._call("/inference/v1/stats"))
        return stats if isinstance(stats, dict) else {}

    def mixed_step_s(self, batch: int, tokens: int, context: int, decode_tokens: int = 128) -> float | None:
        """The step that prefilled a prompt of `tokens` beside `batch` decoding requests, as
        the engine timed it (its stats' `recent_steps`); None if no step of that shape ran
        (the prompt split, or the batch not all decoding at the time)."""
        decoding = threading.Thread(
            target=run_together, args=(lambda: self.generate(context, decode_tokens), batch)
        )
        decoding.start()
        try:
            while True:  # every request of the batch admitted and decoding
                stats = self.stats()
                if stats.get("num_running") == batch and stats.get("last_step_tokens") == batch:
                    break
                if not decoding.is_alive():
                    return None
                time.sleep(POLL_S)
            self.generate(tokens, 1)
            recent = self.stats().get("recent_steps") or []
        finally:
            decoding.join()
        shaped = [float(seconds) for n, seconds in recent if n == batch + tokens]
        return shaped[-1] if shaped else None

    def decode_step_s(self, batch: int, context: int, max_tokens: int) -> float:
        """Median engine-side mean ITL of `batch` requests decoding together."""
        itls: list[float] = []

        def one() -> None:
            itl = (self.generate(context, max_tokens).get("metrics") or {}).get("mean_itl_ms")
            if itl is None:
                raise CalibrationError("the engine's response carries no metrics.mean_itl_ms")
            with self._lock:
                itls.append(float(itl) / 1e3)

        run_together(one, batch)
        itls.sort()
        return itls[len(itls) // 2]


def measure(
    probe: EngineProbe,
    prefill_tokens: Sequence[int] = (32, 64, 128, 256, 512, 1024),
    decode_batches: Sequence[int] = (1, 2, 4, 8, 16),
    decode_contexts: Sequence[int] = (128, 1024),
    decode_tokens: int = 32,
    repeats: int = 3,
    tick: Callable[[], None] | None = None,
    mixed_batches: Sequence[int] = (1, 4),
    mixed_tokens: Sequence[int] = (32, 256),
) -> list[Sample]:
    probe.health()
    probe.generate(16, 2)  # warm-up: first-call costs are not step costs
    samples: list[Sample] = []
    for n in prefill_tokens:
        times = [t for t in (probe.prefill_step_s(n) for _ in range(repeats)) if t is not None]
        if times:
            samples.append(Sample("prefill", n, 0, min(times)))
        if tick:
            tick()
    for context in decode_contexts:  # KV reads grow with the context: bandwidth vs fixed costs
        for b in decode_batches:
            best = min(probe.decode_step_s(b, context, decode_tokens) for _ in range(repeats))
            samples.append(Sample("decode", b, context + decode_tokens // 2, best))
            if tick:
                tick()
    context = min(decode_contexts)
    # a prompt beside decodes: what it adds beyond its tokens (in one step: an engine that
    # caps a prompt's tokens a step beside decodes, as `up`'s do, is probed within its cap)
    # (an engine whose stats do not say what runs is not probed for them)
    stats = probe.stats()
    cap = int(stats.get("long_prefill_token_threshold") or 0)
    for b in mixed_batches if "recent_steps" in stats else ():
        for n in [n for n in mixed_tokens if not 0 < cap < n]:
            times = [t for t in (probe.mixed_step_s(b, n, context) for _ in range(repeats)) if t is not None]
            if times:  # the decodes are some 8 steps in at the prompt's step
                samples.append(Sample("mixed", n, context + 8, min(times), b))
    if len(samples) < 3:
        raise CalibrationError("fewer than 3 usable step shapes (prompts larger than the engine's budget?)")
    return samples


def http_error(url: str, exc: urllib.error.HTTPError) -> CalibrationError:
    """A probe's HTTP error, saying where a refused credential comes from."""
    detail = exc.read().decode(errors="replace")[:200]
    hint = f" (set ${INTERNAL_TOKEN_ENV} to the deployment's token)" if exc.code in (401, 403) else ""
    return CalibrationError(f"{url}: HTTP {exc.code}{hint}: {detail}")


def run_together(task: Callable[[], None], copies: int) -> None:
    """Run `copies` of `task` at once, each in its own thread; the first error any raised
    is raised here, in the caller's thread."""
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            task()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded) for _ in range(copies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
