"""What Ray Serve costs: `splitserve bench` against `splitserve up --ray` (a local two-node
Ray cluster, prefill on one node and decode on the other, KV over tcp, requests through
Serve's HTTP proxy into the ingress) and against `splitserve up` with the same pools and
transport on the same machine. Goodput and TTFT/ITL side by side; the Ray / up ratios last.

    .venv/bin/python benchmarks/bench_ray.py [--model DIR] [--num-requests 24] [--rate 2]

Needs `pip install 'splitserve[ray]'`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from bench_pd_streaming import tiny_model
from bench_render import free_port, served

POOLS = ["--prefill", "1", "--decode", "1", "--render", "1", "--num-blocks", "1024"]
POOLS += ["--min-prefill-tokens", "16", "--pd-decision", "threshold"]
STORE_BYTES = 80 * 1024 * 1024


def warm_up(base: str) -> None:
    """One request through every part before measuring: the first forward pass of a fresh
    engine loads (or builds) the compiled CPU kernels, which is no part of serving."""
    body = {"messages": [{"role": "user", "content": "warm " * 40}], "max_tokens": 4, "temperature": 0}
    httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600).raise_for_status()


def bench(base: str, model: str, args: argparse.Namespace, out: Path) -> dict:
    warm_up(base)
    command = [
        sys.executable, "-m", "splitserve.cli", "bench", "--url", base, "--quiet", "--json", str(out),
        "--tokenizer", model,
        "--num-requests", str(args.num_requests), "--rate", str(args.rate),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_up(model: str, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "splitserve.cli", "up", model, *POOLS, "--transport", "tcp"]
    with served([*command, "--port", str(port)], port, "up") as base:
        return bench(base, model, args, out)


def run_ray(model: str, args: argparse.Namespace, out: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    node = {"object_store_memory": STORE_BYTES, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"a": 1}, **node})
    cluster.add_node(num_cpus=2, resources={"b": 1}, **node)
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    port = free_port()
    try:
        up = [
            sys.executable, "-m", "splitserve.cli", "up", model, *POOLS, "--port", str(port),
            "--ray", cluster.address, "--ray-tier", "render:num_cpus=0.5",
            "--ray-tier", "prefill:num_cpus=0.5,a=1", "--ray-tier", "decode:num_cpus=0.5,b=1",
        ]  # fmt: skip
        subprocess.run(up, check=True, stdout=sys.stderr)
        return bench(f"http://127.0.0.1:{port}", model, args, out)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def headline(data: dict) -> dict[str, float]:
    summary = data["levels"][0]["summary"]
    goodput = next(iter(summary["goodput"].values()))
    return {
        "goodput (req/s)": goodput,
        "TTFT p50 (ms)": summary["ttft"]["p50"] * 1e3,
        "TTFT p90 (ms)": summary["ttft"]["p90"] * 1e3,
        "ITL p50 (ms)": summary["itl"]["p50"] * 1e3,
        "ITL p90 (ms)": summary["itl"]["p90"] * 1e3,
        "output tokens/s": summary["output_throughput"],
        "failed": summary["failed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a tiny random model")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    model = tiny_model(args.model)
    with tempfile.TemporaryDirectory() as directory:
        up = headline(run_up(model, args, Path(directory) / "up.json"))
        on_ray = headline(run_ray(model, args, Path(directory) / "ray.json"))
    print(f"{'':<18}{'up':>10}{'up --ray':>10}{'ray / up':>10}")
    for label, value in up.items():
        ratio = on_ray[label] / value if value else float("nan")
        print(f"{label:<18}{value:>10.2f}{on_ray[label]:>10.2f}{ratio:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
