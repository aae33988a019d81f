"""Idle CPUs lent from one engine to another on the same host (`up` with pinned engines).

`up --cpu-affinity prefill=0,decode=1` keeps a prefill off decode's core, so a prompt
never stalls decode's streams; but an idle stack then prefills a lone prompt on one core
while the other does nothing (a 1k-token first turn took twice `serve`'s time). A decode
engine that has nothing to compute lends its CPUs; a prefill engine borrows them for a
step while the lender stays idle.

The state is a lock file per lender. The lender writes its CPU list into it and holds a
shared `flock` from the end of a step that computed until it goes idle (a step that
only reserves blocks for a pushed prompt computes nothing: decode reserves while prefill
starts, and that must not look busy). A borrower about to run a large step tries an
exclusive `flock` without waiting and lets go at once: got it, the lender was idle at
that moment and the step runs on the borrower's CPUs and the lender's. A lender that
dies drops its lock with its process, so its (idle) CPUs are lent until it comes back;
nobody ever waits on the lock. A lender that starts computing while a borrowed step runs
shares its core for its own first step and what is left of the borrowed one (at most one
chunk of prefill, `--max-num-batched-tokens`); the next step sees it busy.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os

import torch

logger = logging.getLogger(__name__)


def _parse_cpus(text: str) -> frozenset[int]:
    """The lender's `0,2,3` (its whole affinity); empty for anything else (half-written)."""
    try:
        return frozenset(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        return frozenset()


class IdleCpuLender:
    """The lending engine's half: busy while it has work, idle (lent) otherwise. Called
    from the engine thread only."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # no borrower reads a half-written list as idle CPUs
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, cpus.encode(), 0)
        self.busy_held = True
        self.idle()

    def set_busy(self, busy: bool) -> None:
        """After each step: busy when it computed. A borrower probing at this instant
        holds the lock for microseconds: then take it after the next step (never wait)."""
        if not busy:
            self.idle()
        elif not self.busy_held:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            self.busy_held = True

    def idle(self) -> None:
        if self.busy_held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.busy_held = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class IdleCpuBorrower:
    """The borrowing engine's half: which of its lenders' CPUs are idle now. A lender file
    that does not exist yet (its engine still starting) lends nothing. Each probe opens the
    file afresh (microseconds, once per large step), so a lender that comes back with a
    new file is seen."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.paths = paths
        self.own_cpus = frozenset(os.sched_getaffinity(0))

    def idle_lent_cpus(self) -> frozenset[int]:
        """The CPUs of the lenders idle right now, less the borrower's own."""
        lent: set[int] = set()
        for path in self.paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lent.update(_parse_cpus(os.pread(fd, 256, 0).decode(errors="replace")))
            except BlockingIOError:
                continue  # busy
            except OSError as exc:
                logger.warning("CPU lending: %s: %s", path, exc)
            finally:
                os.close(fd)  # drops the lock too
        return frozenset(lent) - self.own_cpus


class StepThreads:
    """How many threads, on which CPUs, the engine thread runs a step with: one thread for
    a small step (`serial_step_tokens`), all of its own for a larger one, and its idle
    lenders' CPUs too when it borrows. Changes the calling thread's affinity only; the
    OpenMP workers it starts inherit it (so a borrowed worker may run on either core,
    and idles, passive, while the step count is lower)."""

    def __init__(self, serial_step_tokens: int, borrower: IdleCpuBorrower | None) -> None:
        self.serial_step_tokens = serial_step_tokens
        self.parallel_threads = torch.get_num_threads()
        self.borrower = borrower
        self.borrowed: frozenset[int] = frozenset()
        self.borrowed_steps = 0  # steps that ran on lent CPUs (engine stats)

    def use_for(self, num_tokens: int) -> None:
        if num_tokens <= self.serial_step_tokens:
            self._set(1, frozenset())
            return
        lent = self.borrower.idle_lent_cpus() if self.borrower is not None else frozenset()
        self.borrowed_steps += bool(lent)
        self._set(self.parallel_threads + len(lent), lent)

    def _set(self, threads: int, borrowed: frozenset[int]) -> None:
        if borrowed != self.borrowed and self.borrower is not None:
            os.sched_setaffinity(0, self.borrower.own_cpus | borrowed)
            self.borrowed = borrowed
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
