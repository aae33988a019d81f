"""Nothing of a part outlives the process that started it, however that one ends (SIGKILL
included: no reliance on its clean-up running).

Children. `child_command(argv)` is the command line that runs `splitserve ARGV...` through
this module's launcher, `python -m splitserve.runtime.process_lifetime PARENT_PID ARGV...`,
which, before anything else:
1. asks the kernel for SIGKILL when its parent goes (Linux `prctl(PR_SET_PDEATHSIG)`);
2. checks that its parent is still PARENT_PID: a parent that died between the fork and the
   prctl never sends the signal (the child was already handed to another parent), so the
   launcher exits instead of running the command;
3. runs `splitserve.cli` in the same process (same pid, one interpreter start).

Why a launcher and not `Popen(preexec_fn=...)`: `preexec_fn` runs between fork and exec in
a copy of the parent, and when the parent has threads (a Ray replica has dozens; `up` and
its HTTP clients some) a lock another thread held at the fork (the import lock, malloc's,
logging's) is never released in the copy: the child can hang before it execs. CPython
documents `preexec_fn` as unsafe with threads. The launcher makes its prctl in a fresh,
single-threaded interpreter instead.

SIGKILL, not SIGTERM: a part's graceful stop drains for up to `--drain-timeout`, and with
its supervisor gone nobody would escalate; what a part holds (ports, its KV pool, which is
unlinked as soon as it is created) goes with the process anyway.

The kernel's parent is the *thread* that forked: the signal comes when that thread exits,
even if the rest of the process lives on. Start children from a thread that lives as long
as the process wants them (`up`: its main thread; a Ray replica: its event-loop thread),
never from a short-lived worker thread.

Without prctl (macOS, Windows) the launcher only makes the check of step 2: a child then
outlives a parent killed outright, and is stopped only by its parent's clean-up.

Directories on tmpfs. `owned_directory` names a directory after its owner (PID namespace
and pid); `remove_dead_owners` removes this user's directories whose owner is gone, so a
directory a SIGKILLed owner left is removed by the next one to start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import runpy
import shutil
import signal
import stat
import sys
import tempfile

PARENT_DEATH_SIGNAL = signal.SIGKILL
PARENT_GONE_EXIT_CODE = 3  # the launcher's parent died before the prctl: nothing was run
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_command(argv: list[str]) -> list[str]:
    """The command line of a child that runs `splitserve ARGV...` and that the kernel ends
    when the calling thread (of this process) goes; see the module docstring."""
    return [sys.executable, "-m", __name__, str(os.getpid()), *argv]


def die_with_parent() -> bool:
    """Ask the kernel for `PARENT_DEATH_SIGNAL` when this process's parent goes; False
    where that cannot be asked (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
        return libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (of any user; a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _pid_namespace() -> int:
    """This process's PID namespace (a pid means something only within it); 0 unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owned_directory(prefix: str, root: str) -> str:
    """A new private directory under `root` named `PREFIX<namespace>-<pid>-<random>`."""
    return tempfile.mkdtemp(prefix=f"{prefix}{_pid_namespace()}-{os.getpid()}-", dir=root)


def remove_dead_owners(prefix: str, root: str) -> list[str]:
    """Remove the `owned_directory(prefix, root)` directories of this user whose owner is
    gone (a pid alive again keeps its directory; one of another PID namespace is never
    touched: its pid cannot be checked from here); returns their paths."""
    pattern = re.compile(rf"{re.escape(prefix)}([0-9]+)-([0-9]+)-[A-Za-z0-9_]+")
    namespace, removed = _pid_namespace(), []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match.group(1)) != namespace or process_alive(int(match.group(2))):
            continue
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                shutil.rmtree(path)
                removed.append(path)
    return removed


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    die_with_parent()
    if os.getppid() != parent:
        print(f"splitserve: the parent process {parent} is gone; not starting", file=sys.stderr)
        sys.exit(PARENT_GONE_EXIT_CODE)
    sys.argv = ["splitserve", *argv]
    runpy.run_module("splitserve.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
