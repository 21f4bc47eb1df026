"""`kspeedfs://` for WebDataset's `gopen`, which opens URLs itself (not through fsspec).

`wds.WebDataset("kspeedfs://NAME/shard-{0000..0007}.tar")` then reads each shard through the
fsspec filesystem (kspeedfs.stacks.filesystem: the local node's maps, else the owners, else the
verified source), buffered as gopen's own files are. timm's `wds/` reader opens its info file
and its shards with gopen, so it takes the same URLs (tests/system/test_webdataset.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import io
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

SCHEME = "kspeedfs"
MODULE = "webdataset.gopen"


def gopen_kspeedfs(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> io.BufferedReader:
    """gopen's handler: the URL opened read-only, through a buffer of `bufsize` bytes."""
    import fsspec

    if mode not in ("r", "rb"):
        raise ValueError(f"{url}: kspeedfs:// is read-only (mode {mode!r})")
    fs = fsspec.filesystem(SCHEME)  # one instance per process (fsspec keeps it)
    return io.BufferedReader(fs.open(url, "rb"), buffer_size=max(bufsize, 1 << 16))


def register(module: ModuleType) -> None:
    module.gopen_schemes[SCHEME] = gopen_kspeedfs


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds webdataset.gopen as the other finders do, and registers once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            register(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_when_imported() -> None:
    module = sys.modules.get(MODULE)
    if module is not None:
        register(module)
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
