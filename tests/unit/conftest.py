"""The unit tests' shared helpers (controlfakes.py, beside this file) importable from every
sub-folder: pytest puts only a test module's own folder on sys.path (rootdir-relative "prepend"
import mode, folders without __init__.py), so this one is added once, here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from controlfakes import MemoryEtcd, memory_etcd  # noqa: E402 (needs the path above)


@pytest.fixture
def etcd(monkeypatch: pytest.MonkeyPatch) -> MemoryEtcd:
    """An in-memory etcd behind every ClusterState the test makes (see controlfakes)."""
    return memory_etcd(monkeypatch)
