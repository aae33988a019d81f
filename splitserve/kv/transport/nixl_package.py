"""Finding NIXL, an optional dependency (`pip install 'splitserve[nixl]'`: nixl-cu12).

Kept apart from nixl.py and free of torch, so that `up` (a CPU tier) can refuse
`--transport nixl` before it starts anything when NIXL is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# nixl-cu12 installs `nixl_cu12`; the `nixl` meta-package (and source builds) install `nixl`
NIXL_MODULES = ("nixl_cu12", "nixl")
NIXL_MISSING = "the nixl KV transport needs NIXL, which is not installed: pip install 'splitserve[nixl]'"


def nixl_present() -> bool:
    """Whether a NIXL package is installed, without importing it (it imports torch)."""
    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # ValueError: a module set to None (blocked)
            continue
    return False


def load_nixl() -> ModuleType:
    """The NIXL Python API (`nixl_agent`, `nixl_agent_config`, ...); ImportError naming
    the extra to install when no NIXL package imports."""
    failures = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
    raise ImportError(f"{NIXL_MISSING} ({'; '.join(failures)})")
