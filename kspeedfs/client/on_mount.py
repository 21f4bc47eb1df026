"""What a path on a kspeedfs mount is: the dataset, instance and folder behind it.

The fast path and `preload` given such a path read the cache's own copy instead of reading the
bytes back through FUSE (and caching them a second time). The mount answers the extended
attribute `user.kspeedfs.dataset` on every inode; it is never listed (`listxattr`), so copies
made with `cp -a` or `rsync -X` do not carry it, and it is asked only of a path whose device
is a kspeedfs mount's (/proc/self/mountinfo).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from typing import Any

from kspeedfs.client import admin
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import DatasetEntry, List, LoadingEntry
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.system.mountinfo import mount_entries

DATASET_XATTR = "user.kspeedfs.dataset"


@dataclasses.dataclass(frozen=True)
class MountedPath:
    """A path on a kspeedfs mount: `dataset` "" at the root of a mount of every dataset."""

    path: str
    dataset: str
    instance: str = ""
    source: str = ""
    rel: str = ""  # the path inside the dataset ("" its root)
    variant: bool = False  # inside a decoded variant's folder (NAME@N)

    def describe(self) -> str:
        """`PATH is dataset D` or `PATH is folder F of dataset D`, on a kspeedfs mount."""
        inside = f"{self.rel} of dataset {self.dataset}" if self.rel else f"dataset {self.dataset}"
        return f"{self.path} is {inside} on a kspeedfs mount"


def describe_attr(dataset: str, instance: str, source: str, rel: str, variant: bool) -> bytes:
    """The value of DATASET_XATTR the mount answers."""
    fields = {"dataset": dataset, "instance": instance, "source": source, "path": rel}
    return json.dumps(dict(fields, variant=variant), sort_keys=True).encode()


def behind(path: str | os.PathLike[str]) -> MountedPath | None:
    """What the kspeedfs mount holding `path` says it is; None when no kspeedfs mount holds
    it (or it does not exist: the caller says so). A kspeedfs mount that does not answer the
    attribute (an older release) is refused in one line."""
    shown = os.fspath(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not any(e.device == device and e.is_kspeedfs for e in mount_entries()):
        return None
    try:
        raw = os.getxattr(path, DATASET_XATTR)
    except OSError as e:
        why = "it does not say which dataset it is" if e.errno == errno.ENODATA else e.strerror
        raise InvalidArgument(
            f"{shown} is on a kspeedfs mount ({why}): give the dataset's source instead"
        ) from None
    try:
        d: dict[str, Any] = json.loads(raw)
        return MountedPath(
            shown,
            str(d["dataset"]),
            str(d.get("instance", "")),
            str(d.get("source", "")),
            str(d.get("path", "")),
            bool(d.get("variant", False)),
        )
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument(f"{shown} is on a kspeedfs mount that answers {raw[:80]!r}") from None


def check_dataset(on: MountedPath, objname: str | None = None) -> None:
    """Refuse (one line) what cannot stand for a dataset's folder: a mount's root, a decoded
    variant's folder, or another dataset than `objname`."""
    if not on.dataset:
        raise InvalidArgument(
            f"{on.path} is the root of a kspeedfs mount: give a dataset's folder in it"
        )
    if on.variant:
        raise InvalidArgument(
            f"{on.path} is in a decoded variant's folder on a kspeedfs mount ({on.dataset}):"
            " give the dataset's own folder (and decoded=N)"
        )
    if objname is not None and objname != on.dataset:
        raise InvalidArgument(f"{on.describe()}, not of dataset {objname}")


def held_here(settings: Settings, on: MountedPath) -> DatasetEntry | LoadingEntry | None:
    """The listing of the dataset behind `on` where these nodes hold it (same name and
    source); None where they do not: that mount is another cluster's, a source like any
    other."""
    with admin.connect(settings) as client:
        listed = client.call(List()).datasets
    found = [d for d in listed if d.name == on.dataset and d.source == on.source]
    return found[0] if found else None
