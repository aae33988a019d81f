"""`splitserve bench`: the goodput benchmark for any OpenAI-compatible server.

`splitserve bench --url URL` is a short run: 32 requests (after 2 warm-up requests) of
256 prompt tokens and 64 output tokens, Poisson arrivals at 2 req/s, judged against the
seed's two targets (TTFT <= 2 s with TPOT <= 30 ms, and TTFT <= 2 s with no gap > 100 ms).
`--rate 1,2,4,8` sweeps rates and reports DistServe goodput; `--compare A.json B.json`
prints two saved runs side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from rich.console import Console

from splitserve.bench.client import ENDPOINTS, ClientConfig
from splitserve.bench.load import LoadSpec
from splitserve.bench.report import LiveProgress, print_compare, print_summary
from splitserve.bench.runner import (
    BenchPlan,
    local_tokenizer,
    read_json,
    run_benchmark,
    server_model,
    write_json,
)
from splitserve.bench.workload import PromptFactory, SessionFactory, SyntheticSpec, Tokenizer, load_dataset
from splitserve.goodput import ARRIVALS, SLO, Lengths

DEFAULT_SLOS = ("ttft=2s,tpot=30ms", "ttft=2s,gap=100ms")
DEFAULT_NUM_REQUESTS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    target = parser.add_argument_group("server")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    target.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY"),
        help="the server's API key (default: $SPLITSERVE_API_KEY)",
    )
    target.add_argument(
        "--model", help="model name to request (default: the first of the server's /v1/models)"
    )
    target.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="local model directory whose tokenizer.json makes prompt lengths exact",
    )
    target.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    target.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one whole request")
    target.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (for servers that reject it)"
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--rate", default="2", help="requests (sessions) per second; a comma list sweeps; inf = all at once"
    )
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    load.add_argument(
        "--concurrency", type=int, help="cap on requests in flight (with --rate inf: closed loop)"
    )
    load.add_argument(
        "--num-requests", type=int, help=f"measured requests per level (default {DEFAULT_NUM_REQUESTS})"
    )
    load.add_argument("--duration", type=float, help="seconds per level during which requests start")
    load.add_argument(
        "--warmup", type=int, default=2, help="requests sent first at each level and not measured"
    )
    load.add_argument("--seed", type=int, default=0)

    work = parser.add_argument_group("workload")
    work.add_argument("--input-len", default="256", help="prompt tokens: N or LOW:HIGH (uniform)")
    work.add_argument(
        "--output-len", default="64", help="output tokens: N or LOW:HIGH (uniform), with ignore_eos"
    )
    work.add_argument("--prefix-len", type=int, default=0, help="tokens of a prefix shared within a group")
    work.add_argument("--num-prefix-groups", type=int, default=1, help="groups of requests sharing a prefix")
    work.add_argument("--turns", type=int, default=1, help="turns per session; each resends the conversation")
    work.add_argument(
        "--think-time", type=float, default=0.0, help="seconds between an answer and the next turn"
    )
    work.add_argument("--dataset", metavar="FILE.jsonl", help="replay chats from a JSONL file instead")

    judge = parser.add_argument_group("targets and output")
    judge.add_argument(
        "--slo",
        action="append",
        help="a target such as ttft=2s,tpot=30ms,gap=100ms; repeatable (default: "
        + " and ".join(DEFAULT_SLOS)
        + ")",
    )
    judge.add_argument("--attainment", default="90%", help="fraction meeting a target for DistServe goodput")
    judge.add_argument("--json", metavar="FILE", help="write per-request and aggregate results")
    judge.add_argument("--plot", metavar="FILE.png", help="write attainment, ITL CDF and timeline plots")
    judge.add_argument("--quiet", action="store_true", help="no live progress display")
    judge.add_argument(
        "--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two saved runs and exit"
    )


def run(args: argparse.Namespace) -> int:
    out = Console(soft_wrap=True, highlight=False)
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    if args.compare:
        try:
            a, b = (read_json(path) for path in args.compare)
        except ValueError as exc:
            return _fail(str(exc))
        print_compare(a, b, args.compare[0], args.compare[1], out)
        return 0
    try:
        client, loads, slos, required = _parse(args)
    except ValueError as exc:
        return _fail(str(exc))

    try:
        client, tokenizer, workload = _workload(args, client)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    if tokenizer is None and not args.dataset:
        err.print("[yellow]no --tokenizer: prompt lengths are approximate (one word is about one token)[/]")

    settings = {
        "url": client.base_url,
        "model": client.model,
        "endpoint": client.endpoint,
        "tokenizer": args.tokenizer,
        "exact_lengths": tokenizer is not None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "num_prefix_groups": args.num_prefix_groups,
        "turns": args.turns,
        "dataset": args.dataset,
        "timeout": client.timeout,
        "ignore_eos": client.ignore_eos,
    }
    plan = BenchPlan(client, loads, slos, required)
    count = tokenizer.count if tokenizer is not None else None
    if args.quiet:
        result = run_benchmark(plan, workload, settings, count)
    else:
        with LiveProgress(err) as progress:
            result = run_benchmark(
                plan, workload, settings, count, progress.level_started, progress.request_done
            )
    print_summary(result, out)
    if args.json:
        write_json(result, args.json)
        err.print(f"wrote {args.json}")
    if args.plot:
        from splitserve.bench.plots import write_plot

        write_plot(result, args.plot)
        err.print(f"wrote {args.plot}")
    if all(level.summary.completed == 0 for level in result.levels):
        print("splitserve bench: no request succeeded", file=sys.stderr)
        return 1
    return 0


def _workload(
    args: argparse.Namespace, client: ClientConfig
) -> tuple[ClientConfig, Tokenizer | None, SessionFactory]:
    """The model to ask for (from the server if not given), the tokenizer and the workload."""
    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    if client.model == "":
        model_info = server_model(client.base_url, api_key=client.api_key)
        client = dataclasses.replace(client, model=str(model_info.get("id", "")))
    else:
        model_info = {"id": client.model}
    if tokenizer is None:
        tokenizer = local_tokenizer(model_info)
    prompts = PromptFactory(tokenizer, args.seed)
    output_len = Lengths.parse(args.output_len)
    dataset = load_dataset(args.dataset, prompts, output_len, args.seed) if args.dataset else None
    synthetic = SyntheticSpec(
        input_len=Lengths.parse(args.input_len),
        output_len=output_len,
        prefix_len=args.prefix_len,
        num_prefix_groups=args.num_prefix_groups,
        turns=args.turns,
    )
    return client, tokenizer, SessionFactory(prompts, synthetic, args.seed, dataset)


def _fail(message: str) -> int:
    print(f"splitserve bench: error: {message}", file=sys.stderr)
    return 2


def _parse(args: argparse.Namespace) -> tuple[ClientConfig, tuple[LoadSpec, ...], tuple[SLO, ...], float]:
    """Check every flag up front so a bad one fails before any request is sent."""
    rates = _parse_rates(args.rate)
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    if args.prefix_len < 0 or args.num_prefix_groups < 1 or args.turns < 1:
        raise ValueError("--prefix-len must be >= 0, --num-prefix-groups and --turns >= 1")
    if args.dataset and (args.turns > 1 or args.prefix_len):
        raise ValueError(
            "--dataset replays recorded chats: it cannot be combined with --turns or --prefix-len"
        )
    Lengths.parse(args.input_len)
    Lengths.parse(args.output_len)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: the directory does not exist")
    loads = tuple(
        LoadSpec(
            rate=rate,
            arrival=args.arrival,
            burstiness=args.burstiness,
            concurrency=args.concurrency,
            num_requests=num_requests,
            duration=args.duration,
            warmup=args.warmup,
            think_time=args.think_time,
            seed=args.seed + index,
        )
        for index, rate in enumerate(rates)
    )
    slos = tuple(SLO.parse(text) for text in (args.slo or DEFAULT_SLOS))
    if len({slo.name for slo in slos}) != len(slos):
        raise ValueError("the same --slo is given twice")
    client = ClientConfig(
        base_url=args.url,
        model=args.model or "",
        endpoint=args.endpoint,
        timeout=args.timeout,
        ignore_eos=not args.no_ignore_eos,
        api_key=args.api_key,
    )
    return client, loads, slos, _parse_fraction(args.attainment)


def _parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"bad --rate {text!r}: give numbers (req/s) or inf, comma-separated") from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"bad --rate {part!r}: a rate must be positive")
        rates.append(rate)
    if rates != sorted(rates):
        raise ValueError(f"bad --rate {text!r}: list a sweep's rates in increasing order")
    return rates


def _parse_fraction(text: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"bad --attainment {text!r}: give a percentage (90%) or a fraction (0.9)") from None
    if not 0 < value <= 1:
        raise ValueError(f"bad --attainment {text!r}: must be in (0, 100%]")
    return value
