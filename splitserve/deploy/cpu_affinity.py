"""`up --cpu-affinity`: which CPUs each part of the stack may run on.

`prefill=0,decode=1` pins every prefill engine to CPU 0 and every decode engine to CPU 1,
so a prefill never steals decode's core (the seed's "no interference" on a small host).
A key is a role (`render`, `prefill`, `decode`, `encoder`, `proxy`: each part of it) or one
part (`decode-1`, which beats its role's entry); a value is a CPU list as `taskset -c`
reads it (`0`, `0-3`, `0,2`: a number after a comma with no `=` continues the list before
it). The flag repeats. Parts it does not name run on every CPU, as without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

ROLES = ("render", "prefill", "decode", "encoder", "ffn", "proxy")
# Read by torch (intra-op threads) and the BLAS libraries: one thread per CPU a part owns,
# so a pinned engine does not run more threads than its cores.
THREADS_ENV = "OMP_NUM_THREADS"


def part_role(name: str) -> str:
    """`decode-1` -> `decode`; `render` -> `render`."""
    return name.rsplit("-", 1)[0] if name[-1:].isdigit() and "-" in name else name


def _cpu_list(text: str, available: frozenset[int]) -> frozenset[int]:
    cpus: set[int] = set()
    for item in text.split(","):
        low, sep, high = item.strip().partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: give CPU numbers such as 0, 0-3 or 0,2") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {item.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    missing = sorted(cpus - available)
    if missing:
        raise ValueError(
            f"CPU {', '.join(map(str, missing))} is not available to this process "
            f"(available: {', '.join(map(str, sorted(available)))})"
        )
    return frozenset(cpus)


def parse_cpu_affinity(
    entries: Sequence[str], part_names: Sequence[str], available: frozenset[int] | None = None
) -> dict[str, frozenset[int]]:
    """Each named part of `part_names` -> its CPUs; raises ValueError naming the bad entry."""
    available = frozenset(os.sched_getaffinity(0)) if available is None else available
    keys: dict[str, str] = {}  # key -> its CPU list text
    for entry in entries:
        last_key = None
        for token in entry.split(","):
            key, sep, value = token.partition("=")
            if not sep:
                if last_key is None or not token.strip():
                    raise ValueError(f"bad --cpu-affinity {entry!r}: use PART=CPUS, e.g. prefill=0,decode=1")
                keys[last_key] += "," + token
                continue
            key = key.strip()
            if key not in ROLES and key not in part_names:
                raise ValueError(
                    f"bad --cpu-affinity {entry!r}: no part {key!r} in this stack "
                    f"(roles: {', '.join(ROLES)}; parts: {', '.join(part_names)})"
                )
            if key in keys:
                raise ValueError(f"--cpu-affinity gives {key!r} twice")
            keys[key], last_key = value, key
    cpus = {key: _cpu_list(text, available) for key, text in keys.items()}
    pinned = {}
    for name in part_names:
        chosen = cpus.get(name, cpus.get(part_role(name)))
        if chosen is not None:
            pinned[name] = chosen
    return pinned


def idle_cpu_lenders(pinned: dict[str, frozenset[int]]) -> dict[str, list[str]]:
    """Each pinned prefill part -> the pinned decode parts on other CPUs than its own, whose
    CPUs it may borrow while they are idle (engine/cpu_lending.py). Unpinned parts lend
    and borrow nothing: they already run on every CPU."""
    decodes = [name for name in pinned if part_role(name) == "decode"]
    lenders = {}
    for name, cpus in pinned.items():
        if part_role(name) == "prefill":
            chosen = [d for d in decodes if not pinned[d] & cpus]
            if chosen:
                lenders[name] = chosen
    return lenders


def pin(pid: int, cpus: frozenset[int]) -> None:
    """Move a just-started part onto `cpus`. It is called right after the exec, before the
    interpreter has started any thread, so every thread the part starts inherits it."""
    os.sched_setaffinity(pid, cpus)
