"""A soak under faults: `up --prefill 1 --decode 2 --render 2`, `--streams` concurrent
greedy streams for `--minutes` while a seeded fault injector, every `--fault-every` seconds
(drawn between the two bounds), SIGKILLs or SIGSTOPs a random part (a render replica, the
prefill or a decode worker; never the proxy, whose death ends its clients' connections
by definition). A stopped part is resumed (SIGCONT) after `--stop-for` seconds, unless
`up`'s liveness check (`--liveness-timeout`) has killed it first; a killed part is started
again by `up`'s supervisor, and the proxy moves the streams of a dead or stalled decode
worker to the other one (`--stall-timeout`, `--resume-wait`). The injector strikes only
when every part answers again and the proxy has every worker back in rotation: one fault
at a time.

Each stream sends one of `--prompts` fixed token-ID prompts (greedy, ignore_eos, token IDs
returned); the reference answer of every prompt is its run on the same stack before any
fault. Printed: requests sent, completed, lost (the warm-up's too); streams differing from
their reference;
the resident memory (VmRSS) of each part at the start (after the reference pass and
`--warm-up` seconds of the same load without faults: what a part grows by as it warms up
is not a leak), halfway and at the end; the KV blocks in use on each engine (blocks total - free, its
/inference/v1/stats) once the load is over. The must-hold verdicts come last and the exit
status says whether all held: 0 lost, 0 differing, RSS within `--rss-tolerance` of the
start (per part name: a restarted part is its new process), 0 blocks in use.

    .venv/bin/python benchmarks/soak_faults.py [--minutes 30] [--streams 64] [--seed 0] [--model DIR]
    .venv/bin/python benchmarks/soak_faults.py --seconds 30 --streams 8 --warm-up 0 --fault-every 5 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_load_up import rss_kib
from bench_migration_resume import part_pid, part_urls, up_log
from bench_pd_streaming import tiny_model
from bench_render import free_port, served

TOKEN = "soak-faults-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAULTED_PARTS = ("render-0", "render-1", "prefill-0", "decode-0", "decode-1")
ENGINES = ("prefill-0", "decode-0", "decode-1")


class Tally:
    """What the clients saw."""

    def __init__(self) -> None:
        self.sent = 0
        self.completed = 0
        self.differing = 0
        self.lost: collections.Counter[str] = collections.Counter()  # by what went wrong


async def one_stream(
    client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int
) -> list[int] | str:
    """The stream's token IDs when it finished with all of them; else what went wrong."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    tokens: list[int] = []
    finish_reason = None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread())[:160]!r}"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "choices" not in event:
                        return f"in-band: {line[:160]}"
                    for choice in event["choices"]:
                        tokens += choice.get("token_ids") or []
                        finish_reason = choice.get("finish_reason") or finish_reason
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if finish_reason != "length" or len(tokens) != max_tokens:
        return f"finish_reason {finish_reason} after {len(tokens)} tokens"
    return tokens


def client_for(streams: int) -> httpx.AsyncClient:
    # A stream may wait for a decode worker to come back (--resume-wait) without a byte.
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4))


async def references(base: str, prompts: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    """Every prompt's undisturbed greedy answer, `args.streams` at a time."""
    gate = asyncio.Semaphore(args.streams)

    async def reference(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        async with gate:
            result = await one_stream(client, base, prompt, args.max_tokens)
        if isinstance(result, str):
            raise RuntimeError(f"a reference run failed before any fault: {result}")
        return result

    async with client_for(args.streams) as client:
        return list(await asyncio.gather(*(reference(client, p) for p in prompts)))


async def send_streams(
    base: str, prompts: list[list[int]], expected: list[list[int]], args: argparse.Namespace,
    until: float, tally: Tally,
) -> None:  # fmt: skip
    """`args.streams` clients, each sending one stream after another until `until`."""

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        while time.monotonic() < until:
            choice = rng.randrange(len(prompts))
            tally.sent += 1
            result = await one_stream(client, base, prompts[choice], args.max_tokens)
            if isinstance(result, str):
                tally.lost[result] += 1
                print(f"lost: {result}", flush=True)
            else:
                tally.completed += 1
                tally.differing += result != expected[choice]

    async with client_for(args.streams) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(args.streams)))


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): tells a reused PID apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def every_part_answers(port: int, deadline: float) -> bool:
    """Until every part `up` started answers /health (a restarted one too) and the proxy
    has every P/D worker back in rotation (it re-admits a restarted one at its next health
    check: striking before would be two faults at once); False past `deadline`."""
    with httpx.Client(timeout=2, headers=AUTH) as client:
        while time.monotonic() < deadline:
            try:
                urls = part_urls(port)
                answering = all(client.get(f"{url}/health").status_code == 200 for url in urls.values())
                workers = client.get(f"{urls['proxy']}/workers").json()["workers"]
                if answering and all(worker["healthy"] for worker in workers):
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    return False


class Fault(NamedTuple):
    at_s: float
    part: str
    action: str  # "kill", "stop", or "stop, then killed by up's liveness check"


async def inject_faults(port: int, args: argparse.Namespace, started: float, until: float) -> list[Fault]:
    rng = random.Random(args.seed)
    faults: list[Fault] = []
    while True:
        wait_s = rng.uniform(*args.fault_every)
        part, action = rng.choice(FAULTED_PARTS), rng.choice(("kill", "stop"))
        stop_s = rng.uniform(*args.stop_for)
        await asyncio.sleep(max(0.0, min(wait_s, until - time.monotonic())))
        if time.monotonic() >= until or not await asyncio.to_thread(every_part_answers, port, until):
            return faults
        pid = part_pid(port, part)
        born = start_time(pid)
        at_s = time.monotonic() - started
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(stop_s)
            if start_time(pid) == born:  # still the process it stopped
                os.kill(pid, signal.SIGCONT)
            else:
                action = "stop, then killed by up's liveness check"
            action = f"{action} ({stop_s:.1f} s)"
        faults.append(Fault(at_s, part, action))
        print(f"fault at {at_s:.0f} s: {part} {action}", flush=True)


def blocks_in_use(port: int) -> dict[str, int]:
    urls = part_urls(port)
    with httpx.Client(timeout=10, headers=AUTH) as client:
        stats = {name: client.get(f"{urls[name]}/inference/v1/stats").json() for name in ENGINES}
    return {name: s["num_blocks_total"] - s["num_blocks_free"] for name, s in stats.items()}


def settled_blocks(port: int, wait_s: float) -> dict[str, int]:
    """The blocks in use on each engine, once none is (or after `wait_s`: reservations of
    transfers that never came expire after --kv-reservation-ttl)."""
    deadline = time.monotonic() + wait_s
    while True:
        in_use = blocks_in_use(port)
        if not any(in_use.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.5)


def part_rss(port: int) -> dict[str, int]:
    """KiB by part name, of the process `up` runs under that name now."""
    return {name: rss_kib(part_pid(port, name)) for name in part_urls(port)}


def up_command(model: str, port: int, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "splitserve.cli", "up", model, "--port", str(port)]
    command += ["--prefill", "1", "--decode", "2", "--render", "2", "--num-blocks", str(args.num_blocks)]
    command += ["--max-model-len", str(max(args.prompt_tokens) + args.max_tokens + 16)]
    command += ["--pd-decision", "threshold", "--min-prefill-tokens", "16"]  # most prompts: P/D
    for flag in ("liveness_timeout", "stall_timeout", "resume_wait", "kv_reservation_ttl", "kv_timeout"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return command


def print_report(
    args: argparse.Namespace, seconds: float, tally: Tally, faults: list[Fault],
    rss: tuple[dict[str, int], dict[str, int], dict[str, int]], blocks: dict[str, int], restarts: int,
) -> bool:  # fmt: skip
    kinds = collections.Counter(f.action.split(" (")[0] for f in faults)
    prompts = len(args.prompts_list)
    print(
        f"\nsoak: {seconds:.0f} s after {args.warm_up:.0f} s of warm-up without faults, "
        f"{args.streams} streams, {prompts} prompts, seed {args.seed}"
    )
    print(f"faults: {len(faults)} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items())) or 'none'}); "
          f"parts started again by up: {restarts}")  # fmt: skip
    lost = sum(tally.lost.values())
    print(f"requests sent {tally.sent}, completed {tally.completed}, lost {lost} (warm-up included)")
    for reason, count in tally.lost.most_common(5):
        print(f"    {count} x {reason}")
    print(f"streams differing from their undisturbed greedy run: {tally.differing}")
    start, half, end = rss
    print(f"{'part':<12}{'RSS start MiB':>15}{'halfway':>9}{'end':>8}{'change':>9}")
    rss_within = True
    for name in start:
        change = (end[name] - start[name]) / max(start[name], 1)
        rss_within &= change <= args.rss_tolerance
        mib = [figures[name] / 1024 for figures in (start, half, end)]
        print(f"{name:<12}{mib[0]:>15.1f}{mib[1]:>9.1f}{mib[2]:>8.1f}{change:>+9.1%}")
    print("KV blocks in use at the end: " + ", ".join(f"{n} {b}" for n, b in blocks.items()))
    verdicts = {
        "0 lost": not tally.lost and tally.completed == tally.sent,
        "0 differing": tally.differing == 0,
        f"RSS within {args.rss_tolerance:.0%}": rss_within,
        "0 blocks in use": not any(blocks.values()),
    }
    print("must hold: " + "; ".join(f"{name} {'PASS' if ok else 'FAIL'}" for name, ok in verdicts.items()))
    return all(verdicts.values())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--seconds", type=float, default=None, help="instead of --minutes (the smoke form)")
    parser.add_argument(
        "--warm-up", type=float, default=120.0, help="seconds of the load without faults before the start"
    )
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--seed", type=int, default=0, help="the fault injector's and the clients' seed")
    parser.add_argument(
        "--fault-every", type=float, nargs=2, default=(20.0, 60.0), metavar=("MIN_S", "MAX_S")
    )
    parser.add_argument("--stop-for", type=float, nargs=2, default=(2.0, 15.0), metavar=("MIN_S", "MAX_S"),
                        help="how long a SIGSTOPped part stays stopped")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(24, 160), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per stream")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per engine")
    parser.add_argument("--liveness-timeout", type=float, default=10.0, help="up's")
    parser.add_argument("--stall-timeout", type=float, default=2.0, help="the proxy's")
    parser.add_argument("--resume-wait", type=float, default=120.0, help="the proxy's")
    parser.add_argument("--kv-timeout", type=float, default=10.0, help="the engines'")
    parser.add_argument("--kv-reservation-ttl", type=float, default=30.0, help="the engines'")
    parser.add_argument("--rss-tolerance", type=float, default=0.05, help="RSS growth allowed per part")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    low, high = args.prompt_tokens
    lengths = [rng.randint(low, high) for _ in range(args.prompts)]
    args.prompts_list = [[rng.randrange(300, 2000) for _ in range(n)] for n in lengths]
    return args


def main() -> int:
    args = parse_args()
    model = tiny_model(args.model)
    port = free_port()
    with served(up_command(model, port, args), port, "up", env={"SPLITSERVE_INTERNAL_TOKEN": TOKEN}) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        expected = asyncio.run(references(base, args.prompts_list, args))
        tally = Tally()
        # The same load without faults first: what a part's memory grows by as it warms up
        # (allocator arenas, connection pools) is not a leak.
        warm_until = time.monotonic() + args.warm_up
        asyncio.run(send_streams(base, args.prompts_list, expected, args, warm_until, tally))
        rss_start = part_rss(port)
        started = time.monotonic()
        duration_s = args.seconds if args.seconds is not None else args.minutes * 60
        until = started + duration_s

        async def rss_halfway() -> dict[str, int]:
            await asyncio.sleep(duration_s / 2)
            return part_rss(port)

        async def soak() -> tuple[list[Fault], dict[str, int]]:
            injector = asyncio.create_task(inject_faults(port, args, started, until))
            halfway = asyncio.create_task(rss_halfway())
            await send_streams(base, args.prompts_list, expected, args, until, tally)
            return await injector, await halfway

        faults, rss_half = asyncio.run(soak())
        seconds = time.monotonic() - started
        if not every_part_answers(port, time.monotonic() + 120):
            print("not every part answers /health after the load", flush=True)
        blocks = settled_blocks(port, args.kv_reservation_ttl + 10)
        rss_end = part_rss(port)
        restarts = up_log(port).count(" started again (pid ")
    held = print_report(args, seconds, tally, faults, (rss_start, rss_half, rss_end), blocks, restarts)
    return 0 if held else 1


if __name__ == "__main__":
    raise SystemExit(main())
