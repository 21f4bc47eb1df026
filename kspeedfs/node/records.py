"""A published dataset's record (`DatasetRecord`) and its meta.json, read and replaced through a
descriptor of its folder."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

from kspeedfs.format.localdata import META_FILE
from kspeedfs.node.safedir import FILE_MODE


@dataclasses.dataclass
class DatasetRecord:
    name: str
    uuid: str
    source: str
    lifetime: str  # "offline" (until unload) or "leased" (until the last lease ends)
    replicas: int
    files: int
    bytes: int  # file bytes in the dataset
    # Where its segments lie and what they take: changed only by the placement of segments
    # (node/segments.py: SegmentPlaces), under the budgets' lock or on the read-through
    # cache's event loop.
    stored: int  # bytes of memory it takes (segments + manifest)
    created: float
    path: Path
    segments: int = 0  # segments in the whole dataset
    held: list[int] = dataclasses.field(default_factory=list)  # the ones this node holds
    members: list[str] = dataclasses.field(default_factory=list)  # nodes it was placed over
    disk: list[int] = dataclasses.field(default_factory=list)  # held ones on the disk tier
    disk_stored: int = 0  # bytes of the disk tier it takes
    # Caps on this node (0: none): the most bytes of its segments in memory and on the disk
    # tier (a read-through dataset's: its segments and spilled copies on the disk tier together,
    # kept by the read-through cache).
    max_memory: int = 0
    max_disk: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The one shape of a published dataset on the wire (list, progress): its record, and
        the fields of a finished load's progress."""
        # A shallow copy, not dataclasses.asdict (a deep copy: 19 us of a 150 us progress op).
        d = {f.name: getattr(self, f.name) for f in _RECORD_FIELDS}
        d.update(
            path=str(self.path),
            held=list(self.held),
            members=list(self.members),
            disk=list(self.disk),
            state="ready",
            files_total=self.files,
            bytes_total=self.bytes,
            files_done=self.files,
            bytes_done=self.bytes,
            elapsed=0.0,
            error="",
        )
        return d


_RECORD_FIELDS = dataclasses.fields(DatasetRecord)


def load_meta(folder: int) -> dict[str, Any]:
    """meta.json of the dataset folder `folder` (a descriptor)."""
    fd = os.open(META_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    with os.fdopen(fd) as f:
        meta: dict[str, Any] = json.load(f)
    return meta


def rewrite_meta(folder: int, stored_delta: int, **changes: Any) -> None:
    """Replace meta.json of a published dataset (its folder `folder`) in one rename: its
    `stored` bytes moved by `stored_delta`, `changes` set. Called under the budgets' lock."""
    meta = load_meta(folder)
    meta.update(changes, stored=int(meta["stored"]) + stored_delta)
    tmp = f".meta.{uuid.uuid4().hex[:12]}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(tmp, flags, FILE_MODE, dir_fd=folder), "w") as f:
        json.dump(meta, f)
    os.rename(tmp, META_FILE, src_dir_fd=folder, dst_dir_fd=folder)
