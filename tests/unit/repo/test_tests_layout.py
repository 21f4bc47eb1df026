"""The tests' layout (docs/testing.md): tests/unit is a package of in-process tests, tests/system
a plain folder of process tests, and tests/conftest.py the one module named `conftest` that a
spawned worker can import by name."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_every_test_module_is_in_unit_or_system() -> None:
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test modules directly in tests/ (move them to unit/ or system/): {loose}"


def test_every_folder_of_tests_unit_is_a_package() -> None:
    """A folder without __init__.py would be imported by its own name: its conftest.py would be
    `conftest`, shadowing tests/conftest.py for a spawned worker."""
    folders = [TESTS / "unit", *(p for p in (TESTS / "unit").rglob("*") if p.is_dir())]
    missing = [
        str(f.relative_to(TESTS))
        for f in folders
        if f.name != "__pycache__" and not (f / "__init__.py").exists()
    ]
    assert not missing, f"folders of tests/unit without __init__.py: {missing}"


def test_tests_system_has_no_conftest_or_init() -> None:
    """Its modules import `conftest` by name, which must be tests/conftest.py (sys.path)."""
    found = sorted(
        str(p.relative_to(TESTS))
        for p in (TESTS / "system").rglob("*.py")
        if p.name in ("conftest.py", "__init__.py")
    )
    assert not found, f"tests/system must stay a plain folder: {found}"
