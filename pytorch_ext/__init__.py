"""The PyTorch fast path: datasets that read the cache's shared memory directly, no FUSE hop.

Each name is imported on first use, so a process (a spawned DataLoader worker) pays only for
what it touches: `KSpeedFolder` needs neither torchvision (~1.7 s to import) nor PIL, the
image datasets do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .array import KSpeedDataset
    from .external_source import KSpeedCallable, SampleInfo
    from .folder import KSpeedFolder
    from .image_folder import KSpeedImageFolder
    from .lease import release_all as release_leases
    from .loop_watch import watch
    from .meta import KSpeedMetaDataset
    from .mini_epoch import MiniEpochSampler
    from .prefetch import ClairvoyantSampler
    from .priority import PrioritySampler
    from .tar_folder import KSpeedTarFolder
    from .tar_shards import KSpeedWebDataset

# A public name -> (its module, its name there).
_WHERE = {
    "ClairvoyantSampler": ("prefetch", "ClairvoyantSampler"),
    "KSpeedCallable": ("external_source", "KSpeedCallable"),
    "KSpeedDataset": ("array", "KSpeedDataset"),
    "KSpeedFolder": ("folder", "KSpeedFolder"),
    "KSpeedImageFolder": ("image_folder", "KSpeedImageFolder"),
    "KSpeedMetaDataset": ("meta", "KSpeedMetaDataset"),
    "KSpeedTarFolder": ("tar_folder", "KSpeedTarFolder"),
    "KSpeedWebDataset": ("tar_shards", "KSpeedWebDataset"),
    "MiniEpochSampler": ("mini_epoch", "MiniEpochSampler"),
    "PrioritySampler": ("priority", "PrioritySampler"),
    "SampleInfo": ("external_source", "SampleInfo"),
    "release_leases": ("lease", "release_all"),
    "watch": ("loop_watch", "watch"),
}

__all__ = [
    "ClairvoyantSampler",
    "KSpeedCallable",
    "KSpeedDataset",
    "KSpeedFolder",
    "KSpeedImageFolder",
    "KSpeedMetaDataset",
    "KSpeedTarFolder",
    "KSpeedWebDataset",
    "MiniEpochSampler",
    "PrioritySampler",
    "SampleInfo",
    "release_leases",
    "watch",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = where
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value  # found once: the next use does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
