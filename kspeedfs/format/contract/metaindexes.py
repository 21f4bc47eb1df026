"""The ops of meta-file indexes (kspeedfs.node.metaindexes): a preload's indexes pushed into the
members' stages, a published index served in pieces, and an index added to a published
instance (`meta add`: reserve, put, commit or abort on every member)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from kspeedfs.format.contract import AnswerT, Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.contract.pieces import BlobPiece
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.metaindex import meta_name

# An index's size, at most (a receiver refuses a larger total before writing a byte).
MAX_INDEX_BYTES = 1 << 38


def _index_piece(piece: BlobPiece) -> BlobPiece:
    if piece.total > MAX_INDEX_BYTES:
        raise InvalidArgument(f"a meta index of {piece.total} bytes is over the limit")
    return piece


def index_piece() -> Any:
    """A field holding a piece of a meta index (its total bounded by MAX_INDEX_BYTES)."""
    return checked(_index_piece)


def _metas(names: list[str]) -> list[str]:
    if not names:
        raise InvalidArgument("must name at least one meta file")
    return names


def _add_id(add: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16}", add):
        raise InvalidArgument("must be 16 hex digits")
    return add


def meta_file(default: Any = dataclasses.MISSING) -> Any:
    """A field holding a meta file's path inside the dataset, normalized (meta_name's rule)."""
    return checked(meta_name, default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageMeta(Request["IndexPieceStaged"]):
    """A piece of a meta index into the stage of preload `uuid` (the coordinator's push)."""

    OP = "stage_meta"
    name: str = dataset_name()
    uuid: str
    meta: str = meta_file()
    piece: BlobPiece = index_piece()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchMetaIndex(Request["MetaIndexPiece"]):
    """The piece at `offset` of a published index (uuid: of that instance, "" for any)."""

    OP = "meta_index"
    name: str = dataset_name()
    uuid: str = ""
    meta: str = meta_file()
    offset: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaIndexPiece(Wire):
    """meta_index's answer."""

    name: str
    uuid: str
    meta: str
    piece: BlobPiece


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaAdd(Request["MetaAdded"]):
    """Index meta files of a published dataset on every member; `via`: the node that asked
    the coordinator on a client's behalf (it gets the index too)."""

    OP = "meta_add"
    name: str = dataset_name()
    uuid: str = ""
    meta: list[str] = checked(_metas)
    via: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OneAdd(Request[AnswerT]):
    """One add of the index of `meta` to instance `uuid`, named by its id `add`."""

    name: str = dataset_name()
    uuid: str = ""
    meta: str = meta_file()
    add: str = checked(_add_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaReserve(_OneAdd["IndexReserved"]):
    """Reserve the index's bytes here, unless it is here already."""

    OP = "meta_reserve"
    bytes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaPut(_OneAdd["IndexPiecePut"]):
    """A piece of the index, written under the add's temporary name."""

    OP = "meta_put"
    piece: BlobPiece = index_piece()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaCommit(_OneAdd["IndexCommitted"]):
    """Put the received index in place."""

    OP = "meta_commit"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaAbort(_OneAdd["IndexAddAborted"]):
    """Undo the add here; `drop`: the index it put in place too."""

    OP = "meta_abort"
    drop: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexPieceStaged(Wire):
    """stage_meta: a piece of an index written into the stage; the bytes received so far."""

    received: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexAdded(Wire):
    """One meta file of a meta_add: "added" (built and put on `nodes` members) or "present"
    (indexed there already), with what its index holds."""

    meta: str
    state: Literal["added", "present"]
    rows: int = at_least(0)
    samples: int = at_least(0)
    bad: int = at_least(0)
    missing: int = at_least(0)
    bytes: int = at_least(0)
    nodes: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaAdded(Wire):
    """meta_add: each meta file asked for, indexed on every member of instance `uuid`."""

    name: str
    uuid: str
    indexes: list[IndexAdded]


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexReserved(Wire):
    """meta_reserve: the index's bytes reserved on `node`, or `present` there already (and
    nothing reserved)."""

    node: str
    present: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexPiecePut(Wire):
    """meta_put: a piece written under the add's temporary name; the bytes received so far."""

    node: str
    received: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexCommitted(Wire):
    """meta_commit: whether the index went in place on `node` (not when it was there
    already), and its bytes counted in the instance."""

    node: str
    added: bool
    bytes: int = at_least(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexAddAborted(Wire):
    """meta_abort: the add undone on `node`."""

    node: str
