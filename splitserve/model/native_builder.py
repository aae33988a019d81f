"""The process that compiles the CPU kernels: `python -m splitserve.model.native_builder SPEC`.

native.py starts it in its own session with a JSON spec (what to build, the private
folder to build it in, where the finished library goes, the process that asked, the time
limit). It compiles with `torch.utils.cpp_extension.load` into the private folder, whose
`lock` no other process ever waits on, then renames the library into place, atomically:
a reader sees either no library or a whole one. It holds the flock native.py took on the
folder's `builder.flock` (inherited) until it exits, so others see the build running. A
watchdog kills the whole session (this process, ninja, the compilers: ninja gives each
command its own process group, so this one's group is not enough) when the asking
process dies or the time limit passes: a build never outlives the part that needed it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

WATCH_INTERVAL_S = 0.2


def session_members(session_id: int) -> list[int]:
    """The live processes of a session (zombies, which a kill cannot end, left out)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, _pgrp, session = stat.rpartition(")")[2].split()[:4]  # after (comm)
        if int(session) == session_id and state not in ("Z", "X"):
            members.append(int(entry))
    return members


def kill_session(session_id: int) -> None:
    """SIGKILL every process of the session but the caller, until none is left (what a
    dying ninja spawned meanwhile too). Without /proc: the session leader's group."""
    if not os.path.isdir("/proc"):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session_id, signal.SIGKILL)
        return
    me = os.getpid()
    while others := [pid for pid in session_members(session_id) if pid != me]:
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_session_when_orphaned(parent_pid: int, deadline: float) -> None:
    while os.getppid() == parent_pid and time.monotonic() < deadline:
        time.sleep(WATCH_INTERVAL_S)
    kill_session(os.getsid(0))
    os._exit(1)


def build(spec: dict[str, Any]) -> None:
    from torch.utils.cpp_extension import load

    load(
        name=spec["name"],
        sources=spec["sources"],
        extra_cflags=spec["cflags"],
        extra_ldflags=spec["ldflags"],
        build_directory=spec["build_dir"],
        is_python_module=False,  # also loads it here: a library that does not load is never put in place
        verbose=True,  # into the build's log
    )
    os.replace(spec["built"], spec["library"])


def main() -> int:
    spec = json.loads(sys.argv[1])
    if os.getsid(0) != os.getpid():  # the watchdog kills its session: it must be our own
        print("native_builder: must lead its own session", file=sys.stderr)
        return 2
    deadline = time.monotonic() + spec["timeout_s"]
    threading.Thread(
        target=kill_session_when_orphaned, args=(spec["parent_pid"], deadline), daemon=True
    ).start()
    build(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
