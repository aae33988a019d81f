"""`splitserve down --ray [ADDRESS]`: remove a Ray deployment `up --ray` made."""

from __future__ import annotations

import argparse

from splitserve.ray_serve.cli import add_down_arguments, run_down


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_down_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_down(args)
