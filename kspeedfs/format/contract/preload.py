"""The preload's ops: a client asks a coordinator (`preload`, `progress`); the coordinator
drives every member's stage (node.preload.Stager) through the `stage*`, `commit` and `abort`
ops, admin only.

`progress` and `stage_status` are long-polled: a caller passes the `version` of the state it
saw in `wait_for_change_after` and the answer comes when the state changes or after
`wait_s` seconds, whichever is first (the counts it carries are those of that moment).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from kspeedfs.format.contract import Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.contract.pieces import BlobPiece
from kspeedfs.format.units import MAX_SIZE

Tier = Literal["memory", "disk", "auto"]

# The longest a long-polled answer is held back: well inside a client's timeout.
MAX_WAIT_S = 5.0


def _size_or_none(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise ValueError(f"must be at least 0, not {value}")
    return value


def _cap(value: int) -> int:
    if not 0 <= value <= MAX_SIZE:
        raise ValueError(f"must be between 0 and {MAX_SIZE} bytes, not {value}")
    return value


def cap_bytes() -> int:
    """A per-node cap in bytes (0: none); one larger than the node has free is refused there."""
    result: int = checked(_cap, default=0)
    return result


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preload(Request):
    OP = "preload"
    name: str = dataset_name()
    source: str  # an absolute path or a URL
    lifetime: Literal["", "offline", "leased"] = ""  # "": offline (a job's: leased)
    replicas: int = at_least(1, default=1)
    endpoint: str = ""  # object store endpoint of a URL source
    meta: list[str] = dataclasses.field(default_factory=list)  # meta files to index
    decoded: int | None = checked(_size_or_none, default=None)  # decode its images too: N px
    # Where its segments go: "memory" only; "disk", the disk tier only; "auto", what fits in
    # memory and the rest on the disk tier (memory only on a node without one).
    tier: Tier = "auto"
    # The most of each node's memory and disk tier its segments take there (0: no cap).
    max_memory: int = cap_bytes()
    max_disk: int = cap_bytes()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreloadStarted(Wire):
    name: str
    files_total: int
    bytes_total: int
    nodes: list[str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadProgress(Request):
    """A load's progress, or the record of the dataset once it is published."""

    OP = "progress"
    name: str = dataset_name()
    wait_for_change_after: int = -1  # a version seen before; -1: answer at once
    wait_s: float = at_least(0, default=0.0)  # at most MAX_WAIT_S


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageClaim(Request):
    """Admission: reserve this member's part of a preload before any member loads."""

    OP = "stage_claim"
    name: str = dataset_name()
    uuid: str
    bytes: int = at_least(0)  # in all: the held segments and the manifest's and meta's share
    tier: Tier = "memory"
    segments: list[int] = dataclasses.field(default_factory=list)  # held here, to split
    lengths: list[int] = dataclasses.field(default_factory=list)  # of each one in `segments`
    max_memory: int = cap_bytes()  # the preload's caps (Preload's)
    max_disk: int = cap_bytes()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageReq(Request):
    """Load the held segments straight from the source (the member scans it itself)."""

    OP = "stage"
    name: str = dataset_name()
    uuid: str
    source: str
    segment_size: int = at_least(1)
    segments: list[int] = at_least(0)
    digest: str  # of the coordinator's scan: the member must see the same tree
    endpoint: str = ""
    meta_bytes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePush(Request):
    """Allocate the held segments of a member that cannot read the source; the coordinator
    writes them with stage_put."""

    OP = "stage_push"
    name: str = dataset_name()
    uuid: str
    source: str
    segments: list[int] = at_least(0)
    lengths: list[int] = at_least(0)  # of each segment in `segments`
    manifest_estimate: int = at_least(0, default=0)
    meta_bytes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePut(Request):
    """A piece of a pushed segment (its total: the segment's length)."""

    OP = "stage_put"
    name: str = dataset_name()
    uuid: str
    segment: int = at_least(0)
    piece: BlobPiece


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageDone(Request):
    """Every piece of a pushed stage was put: checksum its segments."""

    OP = "stage_done"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageStatus(Request):
    OP = "stage_status"
    name: str = dataset_name()
    uuid: str
    wait_for_change_after: int = -1
    wait_s: float = at_least(0, default=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageResult(Request):
    """The checksums of a staged part (files and segments)."""

    OP = "stage_result"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageManifest(Request):
    """A piece of the preload's manifest; the last one is checked and put in place."""

    OP = "stage_manifest"
    name: str = dataset_name()
    uuid: str
    piece: BlobPiece


@dataclasses.dataclass(frozen=True, kw_only=True)
class Commit(Request):
    """Publish the staged part with one rename, with the dataset's `meta`."""

    OP = "commit"
    name: str = dataset_name()
    uuid: str
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Abort(Request):
    """Drop a preload's claim and staged part here (nothing when there is none)."""

    OP = "abort"
    name: str = dataset_name()
    uuid: str
