"""What a dataset folder holds on this node: its files' names, meta.json, segment paths, the
damage table's size, and the error a reader raises for a segment that is not the manifest's.

Reading it is the I/O layer's (system/local_dataset.py maps it, system/disk_copies.py reads
and checks its disk-tier part, system/damage.py follows the node's damage news).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import DataError

MANIFEST_FILE = "manifest.ksm"
META_FILE = "meta.json"
SEGMENT_DIR = "seg"
# The instance's damage news (system/damage.py): u64 words, the generation, the scrubber's
# passes, then one per segment (the generation it was last found damaged in).
DAMAGE_FILE = "damage"
SEGSUMS_FILE = "segsums"  # read-through: u64 per segment, xxh3 of its bytes once filled
EPOCH_FILE = "epoch"  # read-through: u64 the node bumps on every eviction
OPEN_DISK_FILES = 64  # disk-tier segments a process keeps open for pread
HASH_CHUNK = 4 << 20  # a whole segment is checked in reads of this size


# Told the segments a process found damaged (from any thread).
DamageReport = Callable[[list[int]], None]


class DamagedSegment(DataError):
    """Bytes of a disk-tier segment that are not the manifest's (flipped, cut short, grown):
    the read goes elsewhere, and the node is told (`segments`)."""

    def __init__(self, message: str, segments: list[int]):
        super().__init__(message)
        self.segments = segments


def segment_path(dataset_dir: Path, seg: int) -> Path:
    return dataset_dir / SEGMENT_DIR / f"{seg:08d}"


def damage_table_size(segments: int) -> int:
    """The bytes of DAMAGE_FILE for an instance of `segments` segments."""
    return 8 * (2 + segments)


def read_meta(dataset_dir: Path) -> dict[str, Any]:
    with open(dataset_dir / META_FILE) as f:
        meta: dict[str, Any] = json.load(f)
    return meta
