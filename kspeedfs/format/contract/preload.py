"""The preload's ops: a client asks a coordinator (`preload`, `progress`); the coordinator
drives every member's stage (node.stager.Stager) through the `stage*`, `commit` and `abort`
ops, admin only.

`progress` and `stage_status` are long-polled: a caller passes the `version` of the state it
saw in `wait_for_change_after` and the answer comes when the state changes or after
`wait_s` seconds, whichever is first (the counts it carries are those of that moment).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Self, get_args

from kspeedfs.format.contract import Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.contract.pieces import BlobPiece, column_from_base64, column_to_base64
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.units import MAX_SIZE

if TYPE_CHECKING:
    import numpy as np

Tier = Literal["memory", "disk", "auto"]

# The states of a load (a coordinator's or a member's part), in the order they come; a
# long-polled answer's `version` is its state's place here (state_version).
LoadState = Literal["scanning", "queued", "receiving", "loading", "staged", "ready", "failed"]
LOAD_STATES: tuple[LoadState, ...] = get_args(LoadState)

# The longest a long-polled answer is held back: well inside a client's timeout.
MAX_WAIT_S = 5.0

# The version of an answer that carries none (a node older than the long poll): a caller that
# passes it on is answered at once, as that node always answers.
UNVERSIONED = -1


def state_version(state: str) -> int:
    """The version of a state (1 on, in the order of LOAD_STATES; 0 for one not listed)."""
    return LOAD_STATES.index(state) + 1 if state in LOAD_STATES else 0


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
class Preload(Request["PreloadStarted"]):
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
    # When it does not fit: wait in the coordinator's queue for room (state "queued") instead
    # of being refused.
    queue: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreloadStarted(Wire):
    name: str
    files_total: int
    bytes_total: int
    nodes: list[str]
    queued: int = 0  # its place in the queue when it waits for room (0: loading)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadProgress(Request["Progressing | Published"]):
    """A load's progress, or the record of the dataset once it is published."""

    OP = "progress"
    name: str = dataset_name()
    wait_for_change_after: int = -1  # a version seen before; -1: answer at once
    wait_s: float = at_least(0, default=0.0)  # at most MAX_WAIT_S

    def answer(self, msg: Mapping[str, Any]) -> Progressing | Published:
        """A published dataset's record (it names its instance), else its load's progress
        (under way, or failed with why)."""
        return Published.from_wire(msg) if "uuid" in msg else Progressing.from_wire(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageClaim(Request["StageClaimed"]):
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
class StageReq(Request["StageStarted"]):
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
class StagePush(Request["StageStarted"]):
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
class StagePut(Request["SegmentPiecePut"]):
    """A piece of a pushed segment (its total: the segment's length)."""

    OP = "stage_put"
    name: str = dataset_name()
    uuid: str
    segment: int = at_least(0)
    piece: BlobPiece


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageDone(Request["PushStaged"]):
    """Every piece of a pushed stage was put: checksum its segments."""

    OP = "stage_done"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageStatus(Request["Progressing"]):
    OP = "stage_status"
    name: str = dataset_name()
    uuid: str
    wait_for_change_after: int = -1
    wait_s: float = at_least(0, default=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageResult(Request["Checksummed"]):
    """The checksums of a staged part (files and segments)."""

    OP = "stage_result"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageManifest(Request["ManifestPieceTaken | ManifestPlaced"]):
    """A piece of the preload's manifest; the last one is checked and put in place."""

    OP = "stage_manifest"
    name: str = dataset_name()
    uuid: str
    piece: BlobPiece

    def answer(self, msg: Mapping[str, Any]) -> ManifestPieceTaken | ManifestPlaced:
        return (
            ManifestPieceTaken.from_wire(msg)
            if "received" in msg
            else ManifestPlaced.from_wire(msg)
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Commit(Request["Committed"]):
    """Publish the staged part with one rename, with the dataset's `meta`."""

    OP = "commit"
    name: str = dataset_name()
    uuid: str
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Abort(Request["Aborted"]):
    """Drop a preload's claim and staged part here (nothing when there is none)."""

    OP = "abort"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progressing(Wire):
    """A load under way (or failed): `progress` while the coordinator loads, `stage_status`
    of a member's part; `version` is its state's (state_version)."""

    state: LoadState
    source: str
    files_total: int = at_least(0)
    bytes_total: int = at_least(0)
    files_done: int = at_least(0)
    bytes_done: int = at_least(0)
    elapsed: float = at_least(0)
    error: str = ""  # why it failed, in one line
    error_kind: str = ""  # the error's class, so a coordinator raises the same one
    version: int = at_least(0, default=UNVERSIONED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Published(Wire):
    """`progress` of a published dataset: its record (node.store.DatasetRecord) and the counts
    of a finished load."""

    name: str
    uuid: str
    source: str
    lifetime: str  # "offline", "leased" or "readthrough"
    replicas: int
    files: int
    bytes: int
    stored: int
    created: float
    path: str
    segments: int
    held: list[int]
    members: list[str]
    # Absent from the records of nodes older than the disk tier and the caps:
    disk: list[int] = dataclasses.field(default_factory=list)
    disk_stored: int = 0
    max_memory: int = 0
    max_disk: int = 0
    state: Literal["ready"] = "ready"
    files_total: int
    bytes_total: int
    files_done: int
    bytes_done: int
    elapsed: float
    error: str = ""
    version: int = at_least(0, default=UNVERSIONED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageClaimed(Wire):
    """A member's part of a preload claimed: its bytes in memory and on the disk tier."""

    node: str
    memory: int = at_least(0)
    disk: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageStarted(Wire):
    """A member's stage begun (stage: loading from the source; stage_push: allocated for the
    coordinator's pieces): its held segments and their bytes."""

    node: str
    segments: int = at_least(0)
    bytes: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentPiecePut(Wire):
    """stage_put: a piece of a pushed segment written."""

    node: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushStaged(Wire):
    """stage_done: every pushed segment received and checksummed."""

    node: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checksummed(Wire):
    """stage_result: the checksums of a staged part. `files` and `sums` are columns (a file's
    index, <u4, and its checksum, <u8) in base64: a million files in one answer."""

    files: str
    sums: str
    segments: dict[str, int]  # a held segment's number (as text: a JSON key) -> its checksum

    @classmethod
    def of(cls, files: dict[int, int], segments: dict[int, int]) -> Checksummed:
        """The answer of a stage whose whole files have checksums `files` (index -> sum)."""
        import numpy as np  # here: the contract is imported by every CLI call, which needs none

        idx = np.array(sorted(files), dtype="<u4")
        sums = np.array([files[int(i)] for i in idx], dtype="<u8")
        return cls(
            files=column_to_base64(idx),
            sums=column_to_base64(sums),
            segments={str(k): v for k, v in segments.items()},
        )

    @classmethod
    def from_wire(cls, msg: Any) -> Self:
        answer = super().from_wire(msg)
        _ = answer.columns  # decodes: bad base64, or columns that differ, refused here once
        return answer

    @functools.cached_property
    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The files' indexes and their checksums (decoded once)."""
        files = column_from_base64(self.files, "<u4", "stage_result files")
        sums = column_from_base64(self.sums, "<u8", "stage_result sums")
        if len(files) != len(sums):
            raise InvalidArgument(f"stage_result: {len(files)} files but {len(sums)} sums")
        return files, sums


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManifestPieceTaken(Wire):
    """stage_manifest of a piece that is not the last: the bytes received so far."""

    node: str
    received: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManifestPlaced(Wire):
    """stage_manifest of the last piece: the whole manifest checked and put in place."""

    node: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Committed(Wire):
    """commit: the staged part published here."""

    node: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Aborted(Wire):
    """abort: the preload's claim and staged part dropped here (if there were any)."""

    node: str
