"""One benchmark: every load level of a sweep against one server, and the goodput over it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx

from splitserve.bench.client import ClientConfig, StreamingClient, bearer
from splitserve.bench.load import LoadSpec, run_load
from splitserve.bench.metrics import RequestRecord, RunSummary, summarize
from splitserve.bench.workload import SessionFactory, Tokenizer
from splitserve.goodput import SLO, distserve_goodput

RESULT_VERSION = 1


class LevelResult(NamedTuple):
    load: LoadSpec
    summary: RunSummary
    records: list[RequestRecord]


class BenchResult(NamedTuple):
    settings: dict  # what was run, as given (for the JSON file and comparisons)
    slos: tuple[SLO, ...]
    required_attainment: float
    levels: list[LevelResult]

    @property
    def distserve_goodput(self) -> dict[str, float]:
        rates = [level.load.rate for level in self.levels]
        return {
            slo.name: distserve_goodput(
                rates, [level.summary.attainment[slo.name] for level in self.levels], self.required_attainment
            )
            for slo in self.slos
        }


@dataclass(frozen=True)
class BenchPlan:
    client: ClientConfig
    loads: tuple[LoadSpec, ...]  # one per level, run in order
    slos: tuple[SLO, ...]
    required_attainment: float = 0.9


def server_model(base_url: str, timeout: float = 10.0, api_key: str | None = None) -> dict:
    """The first model the server lists at /v1/models; raises ValueError with the reason."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, timeout=timeout, headers=bearer(api_key))
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    try:
        models = response.json()["data"]
        return dict(models[0])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(
            f"{url} answered {response.status_code} without a model list; pass --model"
        ) from None


def local_tokenizer(model: dict) -> Tokenizer | None:
    """The tokenizer of a model the server names by a local directory (vLLM's `root`, or an
    id that is a path), if there is one on this machine."""
    for candidate in (model.get("root"), model.get("id")):
        if isinstance(candidate, str) and (Path(candidate) / "tokenizer.json").is_file():
            return Tokenizer(candidate)
    return None


async def run_plan(
    plan: BenchPlan,
    workload: SessionFactory,
    count_tokens: Callable[[str], int] | None = None,
    on_level_start: Callable[[LoadSpec], None] = lambda load: None,
    on_record: Callable[[RequestRecord], None] = lambda record: None,
) -> list[LevelResult]:
    levels = []
    max_connections = max((load.concurrency or 1000) for load in plan.loads)
    async with StreamingClient(plan.client, count_tokens, max_connections=max_connections) as client:
        for load in plan.loads:
            on_level_start(load)
            result = await run_load(load, workload, client, on_record)
            records = sorted(result.records, key=lambda r: r.request_id)
            summary = summarize(records, plan.slos, load.rate, load.concurrency)
            levels.append(LevelResult(load, summary, records))
    return levels


def run_benchmark(
    plan: BenchPlan,
    workload: SessionFactory,
    settings: dict,
    count_tokens: Callable[[str], int] | None = None,
    on_level_start: Callable[[LoadSpec], None] = lambda load: None,
    on_record: Callable[[RequestRecord], None] = lambda record: None,
) -> BenchResult:
    levels = asyncio.run(run_plan(plan, workload, count_tokens, on_level_start, on_record))
    return BenchResult(settings, plan.slos, plan.required_attainment, levels)


# --- JSON: NaN and infinity are not JSON, so they are written as null and "inf". ---


def _plain(value: object) -> object:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def result_to_json(result: BenchResult) -> dict:
    return _plain(
        {
            "version": RESULT_VERSION,
            "settings": result.settings,
            "slos": [slo.name for slo in result.slos],
            "required_attainment": result.required_attainment,
            "goodput_distserve": result.distserve_goodput,
            "levels": [
                {
                    "load": dataclasses.asdict(level.load),
                    "summary": level.summary.to_json(),
                    "requests": [record.to_json() for record in level.records],
                }
                for level in result.levels
            ],
        }
    )


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result_to_json(result), indent=1) + "\n")


def read_json(path: str | Path) -> dict:
    """A results file written by `--json`; raises ValueError if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise ValueError(f"{path} is not JSON") from None
    if not isinstance(data, dict) or data.get("version") != RESULT_VERSION or "levels" not in data:
        raise ValueError(f"{path} is not a `splitserve bench --json` results file")
    return data


def records_of(level: dict) -> list[RequestRecord]:
    return [RequestRecord.from_json(r) for r in level["requests"]]


def rates_of(levels: Sequence[dict]) -> list[float]:
    return [float(level["summary"]["rate"]) for level in levels]
