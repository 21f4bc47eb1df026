"""The unit tests' fixtures. tests/unit is a package (unit.*, found from tests/, which pytest puts
on sys.path for tests/conftest.py), so this file is `unit.conftest` and never shadows
tests/conftest.py: a spawned worker that imports `conftest` by name gets the one it expects."""

from __future__ import annotations

import pytest

from unit.controlfakes import MemoryEtcd, memory_etcd


@pytest.fixture
def etcd(monkeypatch: pytest.MonkeyPatch) -> MemoryEtcd:
    """An in-memory etcd behind every ClusterState the test makes (see controlfakes)."""
    return memory_etcd(monkeypatch)
