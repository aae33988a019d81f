import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    proc = subprocess.run(
        [ruff, "check", "splitserve", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_frontend_router_sim_do_not_import_torch():
    code = (
        "import sys, splitserve.frontend, splitserve.router, splitserve.sim, splitserve.bench;"
        "import pkgutil, importlib\n"
        "for pkg in (splitserve.frontend, splitserve.router, splitserve.sim, splitserve.bench):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "assert 'torch' not in sys.modules, 'a CPU tier imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
