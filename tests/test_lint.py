import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "splitserve"
# The tiers that run on CPU-only hosts: no torch, and nothing of the engine or the model.
CPU_TIERS = (
    "protocol",
    "runtime",
    "frontend",
    "router",
    "service",
    "deploy",
    "ray_serve",
    "sim",
    "bench",
    "kv_store",
)


def _everything_but(*names: str) -> tuple[str, ...]:
    """Every splitserve package and top-level module except `names`."""
    tops = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.rglob("*.py")}
    return tuple(f"splitserve.{top}" for top in sorted(tops - {"__init__", *names}))


# The layering (DESIGN.md, docs/architecture.md): the packages in the first column (a
# subpackage, `kv.transport`, counts with everything under it) reach none of those in the
# second, directly or through any chain of imports (lazy ones inside functions included;
# `if TYPE_CHECKING:` ones, which never run, aside).
LAYERS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (CPU_TIERS, ("torch", "splitserve.engine", "splitserve.model")),
    # the bottom: the wire shapes, then the runtime every tier's process shares
    (("protocol",), _everything_but("protocol")),
    (("runtime",), _everything_but("protocol", "runtime", "config")),
    (("model",), ("splitserve.engine",)),
    (
        ("frontend", "router"),
        ("splitserve.kv", "splitserve.encoder_cache", "splitserve.engine", "splitserve.model"),
    ),
    # kv/'s rooms: the transports know nothing of the connector over them
    (("kv", "encoder_cache"), ("splitserve.engine", "splitserve.model")),
    (("kv.transport", "encoder_cache"), ("splitserve.kv.connector",)),
)
# The imports that break a layer today, each with why it stays for now. An entry that no
# import needs any more fails the test: take it out.
ALLOWED_IMPORTS: dict[tuple[str, str], str] = {
    ("splitserve.ray_serve.ingress", "splitserve.encoder_cache.connector"): (
        "the ingress keeps the deployment's encoder cache: torch only with an encoder tier"
    ),
    ("splitserve.ray_serve.ingress", "splitserve.encoder_cache.tcp"): (
        "the encoder cache's tcp server, in the ingress only with an encoder tier"
    ),
}


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    proc = subprocess.run(
        [ruff, "check", "splitserve", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_tiers_do_not_import_torch_or_the_engine():
    packages = ", ".join(f"splitserve.{name}" for name in CPU_TIERS)
    code = (
        f"import sys, pkgutil, importlib, {packages}\n"
        f"for pkg in ({packages},):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "assert 'torch' not in sys.modules, 'a CPU tier imported torch'\n"
        "above = (['splitserve', 'engine'], ['splitserve', 'model'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in above)\n"
        "assert not bad, f'a CPU tier imported the engine: {bad}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement, at any depth, except those under `if TYPE_CHECKING:`."""
    found: list[ast.ImportFrom | ast.Import] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """splitserve module -> the splitserve modules it imports; and private names imported
    across modules."""
    graph, _, private = _import_graphs()
    return graph, private


def _import_graphs() -> tuple[dict[str, set[str]], dict[str, set[str]], list[str]]:
    """splitserve module -> the splitserve modules it imports; -> the other packages it
    imports (top-level names: `torch`, `httpx`); and private names imported across modules."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    external: dict[str, set[str]] = {name: set() for name in modules}
    private: list[str] = []
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.module and node.module.startswith("splitserve"):
                targets = []
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.append(submodule if submodule in modules else node.module)
                    is_private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if is_private and submodule not in modules:
                        private.append(f"{name} imports {node.module}.{alias.name}")
            else:
                targets = [node.module] if node.module and not node.level else []
            graph[name] |= {t for t in targets if t in modules and t != name}
            external[name] |= {t.split(".")[0] for t in targets if t.split(".")[0] != "splitserve"}
    return graph, external, private


def test_no_import_cycles_and_no_private_names_across_modules():
    graph, private = _import_graph()
    assert not private, private
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def _forbidden(target: str, banned: tuple[str, ...]) -> bool:
    return any(target == name or target.startswith(name + ".") for name in banned)


def test_layers_reach_nothing_above_them_except_the_allowed_imports():
    graph, external, _ = _import_graphs()
    used = {edge for edge in ALLOWED_IMPORTS if edge[1] in graph.get(edge[0], set())}
    assert used == set(ALLOWED_IMPORTS), f"allow-listed, imported no more: {set(ALLOWED_IMPORTS) - used}"
    broken: list[str] = []
    for packages, banned in LAYERS:
        starts = sorted(m for m in graph if _forbidden(m, tuple(f"splitserve.{p}" for p in packages)))
        for start in starts:
            came_from: dict[str, str | None] = {start: None}
            queue = [start]
            while queue:
                module = queue.pop(0)
                for target in sorted(graph[module] | external[module]):
                    if target in came_from or (module, target) in ALLOWED_IMPORTS:
                        continue
                    came_from[target] = module
                    if _forbidden(target, banned):
                        chain = [target]
                        while (step := came_from[chain[-1]]) is not None:
                            chain.append(step)
                        broken.append(" -> ".join(reversed(chain)))
                    elif target in graph:
                        queue.append(target)
    assert not broken, "\n".join(broken)


def test_no_module_over_450_lines():
    too_long = []
    for folder in ("splitserve", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > 450:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not too_long, "\n".join(too_long)
