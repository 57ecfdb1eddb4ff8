"""The import structure of `llmesh/` and `services/`: no import circle among their modules, and no
module reaching into a private name (`_x`, not a dunder) that another of their modules defines.
Read from the source (ast), not by importing it: imports inside functions and under
TYPE_CHECKING count too, since a circle through them is still a tangle."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from llmesh.testing import REPO_ROOT, find_cycle

ROOTS = ("llmesh", "services")
# protoc's output: generated, checked for drift, not edited.
GENERATED = "llmesh.v1."


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, tuple[Path, ast.Module]]:
    found: dict[str, tuple[Path, ast.Module]] = {}
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            name = module_name(path)
            if not name.startswith(GENERATED):
                found[name] = (path, ast.parse(path.read_text(), str(path)))
    return found


def is_package(name: str, known: Iterable[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def absolute(node: ast.ImportFrom, name: str, package: bool) -> str:
    """The module an ImportFrom names, relative imports resolved against `name`."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of `known` this one imports, anywhere in it. `from pkg import sub` names the
    submodule `pkg.sub` when there is one, else the package itself; the parent packages that
    Python also runs on the way are not counted (a package's `__init__` importing its own
    submodules is how a package names its public members, not a circle)."""
    package = is_package(name, known)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, name, package)
            for alias in node.names:
                if f"{module}.{alias.name}" in known:
                    found.add(f"{module}.{alias.name}")
                elif module in known:
                    found.add(module)
    return found - {name}


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    known = set(trees)
    return {name: imports_of(name, tree, known) for name, tree in trees.items()}


# namedtuple's public API is spelled with a leading underscore so it cannot clash with a field.
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_field_defaults", "_make"})


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private_names(tree: ast.Module) -> set[str]:
    """Private names this module defines: functions, classes, attributes it assigns, globals,
    parameters, class-body fields and `__slots__` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # __slots__ entries, getattr/setattr names
    return {n for n in names if private(n)}


def our_module_bindings(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Local names this module binds to another of our modules (`import a.b as m`, `from a import b`)."""
    package = is_package(name, known)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    bound.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, name, package)
            bound.update(alias.asname or alias.name for alias in node.names if f"{module}.{alias.name}" in known)
    return bound


def other_module_bindings(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Local names this module binds to a module or member outside llmesh/ and services/
    (the standard library, torch): their internals are not ours to police."""
    package = is_package(name, known)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ROOTS:
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if absolute(node, name, package).split(".")[0] not in ROOTS:
                bound.update(alias.asname or alias.name for alias in node.names)
    return bound


def root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_reaches(name: str, tree: ast.Module, known: set[str]) -> list[str]:
    """Where this module uses a private name of another: `from m import _x`, `m._x` on one of our
    modules, and `obj._x` (obj not self/cls) where this module defines no `_x` of its own, which
    is as far as a reading without types sees an object of another module's class."""
    own = defined_private_names(tree)
    modules = our_module_bindings(name, tree, known)
    theirs = other_module_bindings(name, tree, known)
    package = is_package(name, known)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = absolute(node, name, package)
            if module in known or module.split(".")[0] in ROOTS:
                found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if private(a.name)]
            continue
        if not isinstance(node, ast.Attribute) or not private(node.attr) or node.attr in NAMEDTUPLE_API:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in modules:
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        elif root_name(base) in theirs:
            continue
        elif node.attr not in own:
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_import_circle_in_llmesh_or_services() -> None:
    graph = import_graph({name: tree for name, (_, tree) in sources().items()})
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle or [])}"


def test_no_module_reaches_into_another_modules_private_names() -> None:
    trees = {name: tree for name, (_, tree) in sources().items()}
    known = set(trees)
    found = [hit for name, tree in trees.items() for hit in private_reaches(name, tree, known)]
    assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_for() -> None:
    known = {
        "services",
        "services.gw",
        "services.gw.core",
        "services.gw.pipe",
        "services.gw.adm",
        "services.gw.adm.cfg",
    }
    # A plain circle, one closed by an import inside a function, one through a relative import.
    core = ast.parse("from services.gw.pipe import Path\n")
    pipe = ast.parse("def run():\n    from services.gw import core\n")
    assert import_graph({"services.gw.core": core, "services.gw.pipe": pipe}) == {
        "services.gw.core": {"services.gw.pipe"},
        "services.gw.pipe": {"services.gw.core"},
    }
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert imports_of("services.gw.adm", ast.parse("from .cfg import X\nfrom . import cfg\n"), known) == {
        "services.gw.adm.cfg"
    }
    assert imports_of("services.gw.adm.cfg", ast.parse("from ..core import X\n"), known) == {"services.gw.core"}
    source = (
        "from services.gw.adm.cfg import _hidden\n"
        "from services.gw import pipe\n"
        "import numpy as np\n"
        "class Gateway:\n"
        "    def __init__(self, other):\n"
        "        self._mine = 1\n"
        "        other._mine = 2\n"
        "    def step(self, path):\n"
        "        pipe._STAGES.clear()\n"
        "        path.gateway._scope()\n"
        "        parts = np.ops._internal + point._replace(x=1)\n"
        "        return self._mine + other._mine + np.__version__\n"
    )
    found = private_reaches("services.gw.core", ast.parse(source), known)
    assert sorted(hit.split(" ", 1)[1] for hit in found) == ["imports _hidden", "path.gateway._scope", "pipe._STAGES"]


def test_the_check_reads_both_trees() -> None:
    names = set(sources())
    assert {"llmesh.settings", "services.gateway.core", "services.gateway.pipeline"} <= names
    assert {"services.gateway.admission", "services.gateway.admission.window"} <= names
    assert not any(name.startswith(GENERATED) for name in names)
