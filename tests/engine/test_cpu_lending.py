"""Idle CPUs lent from a decode engine to a prefill engine (engine/cpu_lending.py): the
lock file's states, a dead lender, and the step's threads and CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from splitserve.deploy.cpu_affinity import idle_cpu_lenders
from splitserve.engine.cpu_lending import IdleCpuBorrower, IdleCpuLender, StepThreads

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="lending needs two CPUs")


def in_thread(function):
    """Run `function` on a thread of its own: it changes its thread's CPU affinity, which
    must not stay on the test runner's main thread (threads started later inherit it)."""
    result: list = []

    def run() -> None:
        try:
            result.append(function())
        except BaseException as exc:  # re-raised on the caller's thread
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def lender_on(cpu: int, path: str) -> IdleCpuLender:
    """A lender whose CPU list is `cpu` (it writes its thread's affinity)."""

    def make() -> IdleCpuLender:
        os.sched_setaffinity(0, {cpu})
        return IdleCpuLender(path)

    return in_thread(make)


def borrower_on(cpu: int, paths: tuple[str, ...]) -> IdleCpuBorrower:
    def make() -> IdleCpuBorrower:
        os.sched_setaffinity(0, {cpu})
        return IdleCpuBorrower(paths)

    return in_thread(make)


@needs_two_cpus
def test_an_idle_lender_lends_and_a_busy_one_does_not(tmp_path):
    path = str(tmp_path / "decode-0")
    lender = lender_on(CPUS[1], path)
    borrower = borrower_on(CPUS[0], (path,))
    try:
        assert borrower.own_cpus == {CPUS[0]}
        assert borrower.idle_lent_cpus() == {CPUS[1]}
        lender.set_busy(True)
        assert borrower.idle_lent_cpus() == frozenset()
        lender.set_busy(True)  # already held: no second lock
        lender.set_busy(False)
        assert borrower.idle_lent_cpus() == {CPUS[1]}
        # a probe never blocks the lender: busy again, and the next probe sees it
        lender.set_busy(True)
        assert lender.busy_held and borrower.idle_lent_cpus() == frozenset()
    finally:
        lender.close()


@needs_two_cpus
def test_a_missing_or_garbled_lender_file_lends_nothing_and_a_late_lender_is_found(tmp_path):
    path = tmp_path / "decode-0"
    borrower = borrower_on(CPUS[0], (str(path),))
    assert borrower.idle_lent_cpus() == frozenset()  # its engine is still starting
    path.write_text("1,x")
    assert borrower.idle_lent_cpus() == frozenset()
    path.unlink()
    lender = lender_on(CPUS[1], str(path))
    assert borrower.idle_lent_cpus() == {CPUS[1]}
    lender.close()


@needs_two_cpus
def test_a_killed_busy_lender_drops_its_lock(tmp_path):
    path = str(tmp_path / "decode-0")
    code = (
        f"import os, sys; os.sched_setaffinity(0, {{{CPUS[1]}}});"
        "from splitserve.engine.cpu_lending import IdleCpuLender;"
        "lender = IdleCpuLender(sys.argv[1]); lender.set_busy(True);"
        "print('busy', flush=True); sys.stdin.read()"
    )
    borrower = borrower_on(CPUS[0], (path,))
    with subprocess.Popen(
        [sys.executable, "-c", code, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "busy\n"
            assert borrower.idle_lent_cpus() == frozenset()
        finally:
            proc.kill()
    assert borrower.idle_lent_cpus() == {CPUS[1]}  # its CPU is idle now


@needs_two_cpus
def test_large_steps_run_on_idle_lent_cpus_and_small_ones_on_one_thread(tmp_path):
    path = str(tmp_path / "decode-0")
    lender = lender_on(CPUS[1], path)
    threads_before = torch.get_num_threads()

    def steps() -> list[tuple[int, frozenset[int]]]:
        os.sched_setaffinity(0, {CPUS[0]})
        torch.set_num_threads(1)
        step_threads = StepThreads(8, IdleCpuBorrower((path,)))
        seen = []
        for num_tokens, busy in ((100, False), (4, False), (100, True), (100, False)):
            lender.set_busy(busy)
            step_threads.use_for(num_tokens)
            seen.append((torch.get_num_threads(), frozenset(os.sched_getaffinity(0))))
        assert step_threads.borrowed_steps == 2
        return seen

    try:
        assert in_thread(steps) == [
            (2, {CPUS[0], CPUS[1]}),  # idle lender: its CPU too
            (1, {CPUS[0]}),  # a small step: one thread, own CPU
            (1, {CPUS[0]}),  # busy lender: own CPUs only
            (2, {CPUS[0], CPUS[1]}),
        ]
    finally:
        torch.set_num_threads(threads_before)
        lender.close()


def test_up_lends_pinned_decodes_to_pinned_prefills_on_other_cpus():
    pinned = {
        "prefill-0": frozenset({0}),
        "prefill-1": frozenset({1}),
        "decode-0": frozenset({1}),
        "decode-1": frozenset({2, 3}),
        "render": frozenset({0}),
    }
    assert idle_cpu_lenders(pinned) == {"prefill-0": ["decode-0", "decode-1"], "prefill-1": ["decode-1"]}
    assert idle_cpu_lenders({"prefill-0": frozenset({0})}) == {}  # an unpinned decode runs everywhere
    assert idle_cpu_lenders({"decode-0": frozenset({0})}) == {}


def test_engine_cli_takes_the_lending_files(tmp_path):
    import argparse

    from splitserve.engine.api import cli as engine_cli

    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    files = [str(tmp_path / "decode-0"), str(tmp_path / "decode-1")]
    args = parser.parse_args(["/m", "--role", "prefill", "--borrow-idle-cpus", *files])
    config = engine_cli.engine_config(args, "/m")
    assert config.cpu_lending.borrow_files == tuple(files) and config.cpu_lending.lend_file is None
    args = parser.parse_args(["/m", "--role", "decode", "--lend-idle-cpus", files[0]])
    assert engine_cli.engine_config(args, "/m").cpu_lending.lend_file == files[0]
    assert Path(files[0]).exists() is False  # the config only names it; the engine creates it
