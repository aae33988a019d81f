"""What a person sees: live progress, the summary table, and two runs side by side."""

from __future__ import annotations

import math

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from splitserve.bench.load import LoadSpec
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.runner import BenchResult, rates_of, result_to_json


def rate_label(rate: float | str) -> str:
    rate = float(rate)
    return "max" if math.isinf(rate) else f"{rate:g}/s"


class LiveProgress:
    """A progress bar per load level, counting done and failed requests (on stderr)."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self._task: int | None = None
        self._errors = 0

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def level_started(self, load: LoadSpec) -> None:
        total = load.num_requests + load.warmup if load.num_requests is not None else None
        self._errors = 0
        cap = f", concurrency {load.concurrency}" if load.concurrency else ""
        self._task = self._progress.add_task(f"rate {rate_label(load.rate)}{cap}", total=total, errors=0)

    def request_done(self, record: RequestRecord) -> None:
        if self._task is None:
            return
        self._errors += not record.ok
        self._progress.update(self._task, advance=1, errors=self._errors)


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1e3:.1f}"


SUMMARY_ROWS = (
    ("ttft", ("p50", "p90", "p99")),
    ("tpot", ("p50", "p90", "p99")),
    ("itl", ("p50", "p90", "p99")),
    ("worst_gap", ("p50", "p90", "p99", "max")),
    ("e2e", ("p50", "p99")),
)


def summary_rows(data: dict) -> list[tuple[str, str, float | None]]:
    """(label, formatted value, raw value) rows of one level's JSON summary."""
    rows: list[tuple[str, str, float | None]] = [
        ("requests", str(data["requests"]), data["requests"]),
        ("completed", str(data["completed"]), data["completed"]),
        ("failed", str(data["failed"]), data["failed"]),
        ("duration (s)", f"{data['duration']:.2f}", data["duration"]),
        ("requests/s", f"{data['request_throughput']:.2f}", data["request_throughput"]),
        ("output tokens/s", f"{data['output_throughput']:.1f}", data["output_throughput"]),
    ]
    for name, stats in SUMMARY_ROWS:
        for stat in stats:
            value = data[name][stat]
            rows.append((f"{name} {stat} (ms)", _ms(value), None if value is None else value * 1e3))
    for slo, value in data["attainment"].items():
        rows.append((f"attainment {slo}", f"{value:.0%}", value))
    for slo, value in data["goodput"].items():
        rows.append((f"goodput {slo} (req/s)", f"{value:.2f}", value))
    return rows


def print_summary(result: BenchResult, console: Console) -> None:
    data = result_to_json(result)
    levels = data["levels"]
    table = Table(title=f"splitserve bench: {data['settings'].get('model')} at {data['settings'].get('url')}")
    table.add_column("metric")
    for level in levels:
        table.add_column(f"rate {rate_label(level['summary']['rate'])}", justify="right")
    columns = [summary_rows(level["summary"]) for level in levels]
    for row_index, (label, _, _) in enumerate(columns[0]):
        table.add_row(label, *(column[row_index][1] for column in columns))
    console.print(table)
    for level in levels:
        errors = level["summary"]["errors"]
        if errors:
            listed = ", ".join(f"{kind} x{count}" for kind, count in sorted(errors.items()))
            console.print(f"rate {rate_label(level['summary']['rate'])}: errors: {listed}")
            for request in level["requests"]:
                if request["error"]:
                    console.print(f"  first error: {request['error']}")
                    break
    required = data["required_attainment"]
    for slo, rate in data["goodput_distserve"].items():
        console.print(f"goodput (DistServe, {required:.0%} attainment) for {slo}: {rate_label_or_zero(rate)}")
    print_slowest_timelines(result, console)


SLOWEST = 5  # requests whose phases `print_slowest_timelines` shows


def print_slowest_timelines(result: BenchResult, console: Console, count: int = SLOWEST) -> None:
    """The server's phases (ms) of the requests with the longest TTFT, where the server
    reported them (`splitserve_timeline`: splitserve's `serve` and proxy)."""
    timed = [
        record
        for level in result.levels
        for record in level.records
        if record.ok and not record.warmup and record.timeline and record.ttft is not None
    ]
    if not timed:
        return
    slowest = sorted(timed, key=lambda record: record.ttft or 0.0, reverse=True)[:count]
    # in the order the server lists them (the request's order)
    phases = list(dict.fromkeys(name for record in slowest for name in record.timeline or {}))
    # a row per phase, a column per request: any number of phases fits the terminal
    table = Table(title=f"server phases of the {len(slowest)} slowest requests by TTFT (ms)")
    table.add_column("phase")
    for record in slowest:
        table.add_column(f"#{record.request_id}", justify="right")
    table.add_row("ttft (client)", *(_ms(record.ttft) for record in slowest))
    table.add_row("e2e (client)", *(_ms(record.e2e) for record in slowest))
    for name in phases:
        table.add_row(name, *(_ms((record.timeline or {}).get(name)) for record in slowest))
    console.print(table)


def rate_label_or_zero(rate: float | str) -> str:
    return "0 (no swept rate met it)" if float(rate) == 0 else rate_label(rate)


def print_compare(a: dict, b: dict, a_name: str, b_name: str, console: Console) -> None:
    """Two results files side by side, level by level, with B / A ratios."""
    table = Table(title=f"A = {a_name}, B = {b_name}")
    for column in ("level", "metric", "A", "B", "B / A"):
        table.add_column(column, justify="left" if column in ("level", "metric") else "right")
    a_rates, b_rates = rates_of(a["levels"]), rates_of(b["levels"])
    for index in range(min(len(a_rates), len(b_rates))):
        rate_a, rate_b = rate_label(a_rates[index]), rate_label(b_rates[index])
        level = rate_a if rate_a == rate_b else f"{rate_a} vs {rate_b}"
        rows_a = summary_rows(a["levels"][index]["summary"])
        rows_b = {label: (text, raw) for label, text, raw in summary_rows(b["levels"][index]["summary"])}
        for label, text_a, raw_a in rows_a:
            if label in rows_b:
                text_b, raw_b = rows_b[label]
                table.add_row(level, label, text_a, text_b, _ratio(raw_a, raw_b))
                level = ""
    for slo, rate_a in a["goodput_distserve"].items():
        rate_b = b["goodput_distserve"].get(slo)
        if rate_b is not None:
            raw_a, raw_b = float(rate_a), float(rate_b)
            table.add_row(
                "sweep", f"goodput (DistServe) {slo}", str(rate_a), str(rate_b), _ratio(raw_a, raw_b)
            )
    console.print(table)
    if len(a_rates) != len(b_rates):
        shared = min(len(a_rates), len(b_rates))
        console.print(f"A has {len(a_rates)} levels, B has {len(b_rates)}: compared the first {shared}")


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or a == 0:
        return "-"
    return f"{b / a:.2f}x"
