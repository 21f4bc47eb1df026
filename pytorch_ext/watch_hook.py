"""KSPEEDFS_WATCH=1: every DataLoader's iterator timed by pytorch_ext.loop_watch, with no code change.

The package installs kspeedfs_watch.pth into site-packages; at interpreter start it imports
this module only when KSPEEDFS_WATCH is set (otherwise it costs one environment lookup). Even
then torch is not imported here: a finder waits for torch's DataLoader module to be imported
by the script and patches it once it has run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

DATALOADER = "torch.utils.data.dataloader"
_noted: set[int] = set()  # loaders whose datasets were looked for


def enabled() -> bool:
    return os.environ.get("KSPEEDFS_WATCH", "") not in ("", "0")


def patch(module: ModuleType) -> None:
    """Time every iterator of the DataLoader in `module` (torch.utils.data.dataloader)."""
    from kspeedfs.client import read_times
    from pytorch_ext.loop_watch import hooked, meter, note_datasets, time_workers

    loader_cls, iter_cls = module.DataLoader, module._BaseDataLoaderIter
    if loader_cls in hooked:
        return
    original_iter, original_next = loader_cls.__iter__, iter_cls.__next__

    def __iter__(self: Any) -> Any:
        time_workers()
        m = meter()
        since = m.enter()
        it = original_iter(self)
        m.started(since)
        if id(self) not in _noted:
            _noted.add(id(self))
            note_datasets(self)
        return it

    def __next__(self: Any) -> Any:
        m = meter()
        since = m.enter()
        try:
            batch = original_next(self)
        except StopIteration:
            m.exhausted(since)
            raise
        m.batch(since, getattr(self._index_sampler, "batch_size", None) or 1)
        return batch

    loader_cls.__iter__ = __iter__
    iter_cls.__next__ = __next__
    hooked.append(loader_cls)
    if read_times.enabled:  # a spawned worker of a watched loader: its fetches timed too
        time_workers()


class _AfterDataLoader(importlib.abc.MetaPathFinder):
    """Finds torch's DataLoader module as the path finder does, and patches it once run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != DATALOADER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch the DataLoader now if torch's is imported, else as soon as it is."""
    if DATALOADER in sys.modules:
        patch(sys.modules[DATALOADER])
    elif not any(isinstance(f, _AfterDataLoader) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDataLoader())
