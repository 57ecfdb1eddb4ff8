"""The suite's own hygiene: no test waits for something to happen by sleeping.

A sleep that waits for an outcome passes on a fast machine and fails on a loaded one (CI's two
slow cores), or passes while the outcome it waits for never came. Tests wait on events and
conditions instead (polling, where the code offers no event, through `llmesh.testing.eventually`
or `wait_until`). What may sleep is simulated work: a fake server's pace, an outage that lasts a
while. Such a line says so with a `# simulated work` comment.

The scan reads every file under tests/ with `ast`: a call of `time.sleep` or `asyncio.sleep`
(under any name they were imported as), or one that hands either on as a callable with its delay
(`loop.call_soon(time.sleep, 0.05)`), is allowed only when its delay is a constant 0 (a yield to
the loop, not a wait) or the call's lines carry the marker. A delay the scan cannot evaluate (a
variable, an attribute) counts as positive: it is a sleep all the same.
"""

from __future__ import annotations

import ast
import io
import operator
import textwrap
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
MARKER = "# simulated work"
SLEEPY_MODULES = ("time", "asyncio")
_UNSET = object()
_OPERATORS: dict[type[ast.AST], Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _comments_by_line(source: str) -> dict[int, str]:
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    return comments


def _module_constants(tree: ast.Module) -> dict[str, object]:
    """Module-level names bound once to a constant expression (`FREEZE_S = 3.0`, `A, B = 1, 2`)."""
    constants: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            constants[target.id] = _evaluate(value, constants)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for name, item in zip(target.elts, value.elts, strict=True):
                if isinstance(name, ast.Name):
                    constants[name.id] = _evaluate(item, constants)
    return constants


def _evaluate(node: ast.expr, constants: dict[str, object]) -> object:
    """The number an expression of constants comes to, or _UNSET where it is not one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id, _UNSET)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        operand = _evaluate(node.operand, constants)
        return _UNSET if operand is _UNSET else _OPERATORS[type(node.op)](operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, constants), _evaluate(node.right, constants)
        if left is _UNSET or right is _UNSET:
            return _UNSET
        try:
            return _OPERATORS[type(node.op)](left, right)
        except ArithmeticError:
            return _UNSET
    return _UNSET


class _SleepFinder(ast.NodeVisitor):
    def __init__(self, tree: ast.Module) -> None:
        self.constants = _module_constants(tree)
        self.modules: set[str] = set()  # names `time` / `asyncio` are bound to
        self.functions: set[str] = set()  # names their `sleep` is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.modules |= {a.asname or a.name for a in node.names if a.name in SLEEPY_MODULES}
            elif isinstance(node, ast.ImportFrom) and node.module in SLEEPY_MODULES:
                self.functions |= {a.asname or a.name for a in node.names if a.name == "sleep"}
        self.found: list[ast.Call] = []

    def is_sleep(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "sleep" and isinstance(node.value, ast.Name) and node.value.id in self.modules
        return isinstance(node, ast.Name) and node.id in self.functions

    def waits(self, delay: ast.expr | None) -> bool:
        """Whether a delay may be positive (a missing one is an error the call makes itself)."""
        if delay is None:
            return False
        value = _evaluate(delay, self.constants)
        return value is _UNSET or value > 0  # type: ignore[operator]

    def visit_Call(self, node: ast.Call) -> None:
        if self.is_sleep(node.func):
            delay = node.args[0] if node.args else next((k.value for k in node.keywords), None)
            if self.waits(delay):
                self.found.append(node)
        else:  # a sleep handed on as a callable, its delay after it: call_soon(time.sleep, 0.05)
            for i, arg in enumerate(node.args[:-1]):
                if self.is_sleep(arg) and self.waits(node.args[i + 1]):
                    self.found.append(node)
                    break
        self.generic_visit(node)


def unmarked_sleeps(source: str, name: str = "<source>") -> list[str]:
    """`name:line: code` of each sleep in `source` that waits without the marker."""
    tree = ast.parse(source, filename=name)
    comments = _comments_by_line(source)
    finder = _SleepFinder(tree)
    finder.visit(tree)
    lines = source.splitlines()
    found = []
    for call in finder.found:
        span = range(call.lineno, (call.end_lineno or call.lineno) + 1)
        if not any(MARKER in comments.get(line, "") for line in span):
            found.append(f"{name}:{call.lineno}: {lines[call.lineno - 1].strip()}")
    return found


def scan(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        found += unmarked_sleeps(path.read_text(encoding="utf-8"), str(path.relative_to(root.parent)))
    return found


def test_no_test_sleeps_to_wait_for_something() -> None:
    found = scan(TESTS)
    assert not found, (
        "sleeps that wait for something (wait on an event, or poll with llmesh.testing.eventually /"
        f" wait_until; a fake's simulated work says `{MARKER}` on its line):\n" + "\n".join(found)
    )


def _flagged(source: str) -> list[int]:
    return [int(hit.split(":")[1]) for hit in unmarked_sleeps(textwrap.dedent(source))]


def test_the_scan_finds_sleeps_under_any_name_and_any_delay() -> None:
    source = """\
        import asyncio
        import time as clock
        from asyncio import sleep as nap
        from time import sleep

        PAUSE_S = 0.5
        A_S, B_S = 0.0, 2 * PAUSE_S

        async def waits(loop, delay):
            await asyncio.sleep(0.1)
            clock.sleep(1)
            await nap(PAUSE_S)
            sleep(B_S)
            await asyncio.sleep(delay)
            await asyncio.sleep(delay=0.2)
            loop.call_soon(clock.sleep, 0.05)
            await asyncio.sleep(
                0.3
            )
    """
    assert _flagged(source) == [10, 11, 12, 13, 14, 15, 16, 17]


def test_the_scan_allows_yields_and_marked_simulated_work() -> None:
    source = """\
        import asyncio
        import time

        NONE_S = 0

        async def fine(server):
            await asyncio.sleep(0)
            await asyncio.sleep(0.0)
            await asyncio.sleep(NONE_S)
            await asyncio.sleep(server.delay)  # simulated work: the fake's pace
            time.sleep(
                0.5,  # simulated work: a slow disk
            )
            text = "asyncio.sleep(1)"
            server.sleep(1)  # another object's sleep, not the clock's
    """
    assert _flagged(source) == []


def test_the_marker_must_be_a_comment_on_the_call() -> None:
    source = """\
        import asyncio

        async def not_fine():
            await asyncio.sleep(1, "# simulated work")
            # simulated work
            await asyncio.sleep(1)
    """
    assert _flagged(source) == [4, 6]
