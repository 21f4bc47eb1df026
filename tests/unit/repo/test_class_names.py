"""Each class name is defined once in the package, so no import needs `as` to tell two apart."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("kspeedfs", "mountd", "pytorch_ext")

# KSpeed's own names, kept by the compatible classes in pytorch_ext/kspeed.py, beside the fast
# path's public classes of the same names: the one pair allowed.
KSPEED_COMPAT = "pytorch_ext/kspeed.py"
KSPEED_PAIR = {"KSpeedDataset", "KSpeedFolder", "KSpeedImageFolder"}


def class_definitions(base: Path, roots: list[str]) -> dict[str, list[str]]:
    """Every class name (top-level or nested) to the places, `path:line` under `base`, that
    define it."""
    where: dict[str, list[str]] = defaultdict(list)
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(base)}:{node.lineno}")
    return where


def duplicates(where: dict[str, list[str]]) -> dict[str, list[str]]:
    found = {}
    for name, places in where.items():
        in_compat = sum(p.startswith(f"{KSPEED_COMPAT}:") for p in places)
        if len(places) > 1 and not (name in KSPEED_PAIR and len(places) == 2 and in_compat == 1):
            found[name] = places
    return found


def test_no_class_name_is_defined_twice() -> None:
    where = class_definitions(ROOT, list(PACKAGES))
    assert len(where) > 100  # the walk found the package
    assert duplicates(where) == {}


def test_a_second_definition_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class Plan:\n    pass\n")
    (tmp_path / "b.py").write_text("def f():\n    class Plan:\n        pass\n")
    (tmp_path / "c.py").write_text("class KSpeedFolder:\n    pass\n")
    found = duplicates(class_definitions(tmp_path, ["."]))
    assert found == {"Plan": ["a.py:1", "b.py:2"]}
