"""A thread's time waiting runnable for a core so far (Linux's per-thread schedstat: run
time, run-queue wait, timeslices): what other processes and threads on its cores took
from it, read rather than inferred from how much longer its work ran."""

from __future__ import annotations

import os
import threading


class ThreadWait:
    """The run-queue wait of the thread that first asks (an engine's step thread): its
    schedstat is opened then and read again at each call. None where the kernel keeps
    none."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def seconds(self) -> float | None:
        if self._fd is None:
            try:
                self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
            except OSError:
                self._fd = -1
        if self._fd < 0:
            return None
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None
