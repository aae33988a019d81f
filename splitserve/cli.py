"""`splitserve <command>`: each command is a thin wrapper over one module.

A command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their command runs, so `splitserve sim` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "tiny-model": ("splitserve.model.tiny", "write a random-weight Hugging Face model directory"),
    "engine": ("splitserve.engine.api.cli", "serve the token-in/token-out engine API"),
    "render": ("splitserve.frontend.cli", "serve the CPU render/derender tier"),
    "serve": ("splitserve.serve.cli", "serve the collocated OpenAI-compatible API"),
    "proxy": ("splitserve.router.cli", "serve the P/D proxy in front of the tiers"),
    "kvstore": ("splitserve.kv_store.cli", "serve the KV store tier (blocks by chained hash, RAM and disk)"),
    "up": ("splitserve.deploy.up_cli", "start the whole disaggregated stack locally (or --ray: on Ray)"),
    "down": ("splitserve.ray_serve.down_cli", "remove a Ray deployment `up --ray` made"),
    "sim": ("splitserve.sim.cli", "simulate and plan deployments (roofline, goodput)"),
    "bench": ("splitserve.bench.cli", "goodput benchmark for any OpenAI-compatible server"),
}


def _usage() -> str:
    lines = ["usage: splitserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n`splitserve <command> --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from splitserve import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"splitserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("splitserve"):
            print(f"splitserve: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"splitserve {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
