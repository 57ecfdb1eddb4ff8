"""The engine package's ownership split: no import cycle among its modules, and no
module reaching into another's private names (`other._private`, `from m import _private`).
Read from the source (ast), not by importing it."""

from __future__ import annotations

import ast
from pathlib import Path

from llmesh.testing import REPO_ROOT, find_cycle

PACKAGE = "services.inference.engine"
ROOT = REPO_ROOT / "services" / "inference" / "engine"


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.glob("*.py"))}


def engine_imports(tree: ast.Module) -> set[str]:
    """The package's modules this one imports, anywhere in it (function bodies and
    TYPE_CHECKING blocks included: a cycle through them is still a tangle)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
            elif node.module == PACKAGE:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.removeprefix(PACKAGE + ".").split(".")[0])
    return found


def own_private_names(tree: ast.Module) -> set[str]:
    """Private names this module defines: functions, classes, attributes it assigns, globals."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def imported_modules(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to this package's modules, names bound to any other module)."""
    ours: set[str] = set()
    theirs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                (ours if alias.name.startswith(PACKAGE + ".") and alias.asname else theirs).add(bound)
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            ours.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(PACKAGE):
            theirs.update(alias.asname or alias.name for alias in node.names)
    return ours, theirs


def root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_reaches(name: str, tree: ast.Module) -> list[str]:
    own = own_private_names(tree)
    ours, theirs = imported_modules(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        root = root_name(node.value)
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if root in ours:  # another engine module's private name
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
        elif root in theirs:  # a third-party library's internals (torch.ops.mkldnn._...): not ours to police
            continue
        elif node.attr not in own:  # an object of another module's class
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_engine_modules_import_no_cycle() -> None:
    trees = modules()
    graph = {name: engine_imports(tree) - {name} for name, tree in trees.items() if name != "__init__"}
    assert set().union(*graph.values()) <= set(graph), "every import names a module of the package"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"
    # The scheduler knows no Engine and no engine core; the output processor no Engine either.
    assert not graph["scheduler"] & {"front", "engine_core", "output"}
    assert not graph["output"] & {"front", "engine_core", "scheduler"}
    assert not graph["sequence"] & {"front", "engine_core", "scheduler", "output"}
    assert "front" not in set().union(*(deps for name, deps in graph.items() if name != "front"))
    # The scheduler decides each step and runs no forward; the executor runs a plan and decides nothing.
    assert not graph["scheduler"] & {"runner", "executor", "llama", "model", "engine_core"}
    assert not graph["executor"] & {"front", "engine_core", "output", "kv_manager"}
    assert graph["messages"] <= {"sequence", "sampling"}


def test_no_module_reaches_into_another_modules_private_names() -> None:
    found = [hit for name, tree in modules().items() for hit in private_reaches(name, tree)]
    assert found == []


def test_the_checks_catch_what_they_are_for() -> None:
    # A cycle and private reaches, in source of the same shape as the package's.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = (
        "from services.inference.engine import scheduler\n"
        "from services.inference.engine.kv_manager import _hidden\n"
        "import torch\n"
        "class Core:\n"
        "    def __init__(self, other):\n"
        "        self._mine = 1\n"
        "        other._mine = 2\n"
        "    def step(self, other):\n"
        "        scheduler._cond.notify()\n"
        "        other.queue._items.clear()\n"
        "        torch.ops.mkldnn._linear_pointwise\n"
        "        return self._mine + other._mine\n"
    )
    found = private_reaches("core", ast.parse(source))
    assert [hit.split(" ", 1)[1] for hit in found] == ["imports _hidden", "scheduler._cond", "other.queue._items"]


def test_the_package_is_what_the_check_reads() -> None:
    assert {"front", "engine_core", "scheduler", "executor", "messages", "sequence", "output", "kv_manager"} <= set(
        modules()
    )
    assert Path(ROOT / "__init__.py").is_file()


def host_imports(tree: ast.Module) -> list[str]:
    """Modules of the inference service outside the engine package that this module imports
    (anywhere in it: a lazy import in a function body still ties the engine to its host)."""
    host = "services.inference"
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != host else [f"{host}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{n}:{node.lineno}" for n in names if n.startswith(host) and not n.startswith(PACKAGE)]
    return found


def test_the_engine_imports_nothing_of_its_host_service() -> None:
    # The engine is a library its host (the inference service) uses: decoding, metrics and the
    # model's quality guard live inside it, and the host passes what else it needs.
    found = {name: hits for name, tree in modules().items() if (hits := host_imports(tree))}
    assert found == {}
    source = "from services.inference import metrics\nimport services.inference.servicer\n"
    source += "from services.inference.engine import decoding\ndef f():\n    from services.inference.quality import x\n"
    assert host_imports(ast.parse(source)) == [
        "services.inference.metrics:1",
        "services.inference.servicer:2",
        "services.inference.quality:5",
    ]
