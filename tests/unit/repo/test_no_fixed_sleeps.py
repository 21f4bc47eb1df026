"""No fixed sleep as synchronisation in the tests: a test waits on a condition (`wait_for`, an
event, a status). A sleep outside a polling loop is left only where time passing is the thing
under test, with a comment saying so ("under test: why") on its line or the line above."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]  # tests/: unit/ and system/ beneath it


def is_sleep(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "sleep"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("time", "trio", "asyncio")
    )


def bare_sleeps(source: str) -> list[int]:
    """Lines of the sleeps outside a loop (a polling loop's sleep is its interval) without an
    "under test" comment on their line or the line above."""
    lines = source.splitlines()
    found: list[int] = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        if is_sleep(node):
            line = node.lineno
            near = [lines[line - 1]] + ([lines[line - 2]] if line > 1 else [])
            commented = any("under test" in text.partition("#")[2].lower() for text in near)
            if not in_loop and not commented:
                found.append(line)
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                in_loop = False  # a function defined in a loop is not the loop's body
            visit(child, in_loop or isinstance(node, ast.While | ast.For | ast.AsyncFor))

    visit(ast.parse(source), False)
    return found


def test_every_sleep_outside_a_loop_says_why() -> None:
    paths = sorted(TESTS.rglob("*.py"))  # tests/unit and tests/system (a mock clock's sleeps too)
    assert {"unit", "system"} <= {p.relative_to(TESTS).parts[0] for p in paths}
    found = {
        str(path.relative_to(TESTS)): lines
        for path in paths
        if (lines := bare_sleeps(path.read_text()))
    }
    assert found == {}, f"fixed sleeps without a reason (wait on a condition instead): {found}"


def test_a_bare_sleep_is_found() -> None:
    source = (
        "import time\n"
        "def f():\n"
        "    time.sleep(1)\n"
        "    time.sleep(2)  # under test: time passing\n"
        "    while True:\n"
        "        time.sleep(0.1)\n"
        "        def g():\n"
        "            time.sleep(3)\n"
    )
    assert bare_sleeps(source) == [3, 8]
