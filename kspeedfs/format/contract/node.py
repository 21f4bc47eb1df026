"""The ops NodeServer itself answers: liveness and what the node holds."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire, at_least, dataset_name
from kspeedfs.format.pieces import PIECE, Piece


@dataclasses.dataclass(frozen=True)
class Ping(Request):
    OP = "ping"


@dataclasses.dataclass(frozen=True)
class Pong(Wire):
    node: str
    version: int


@dataclasses.dataclass(frozen=True)
class Manifest(Request):
    """A piece of a published dataset's manifest (a client or member that holds none of it
    fetches the whole file piece by piece, with kspeedfs.format.pieces.fetch_all)."""

    OP = "manifest"
    name: str = dataset_name()
    offset: int = at_least(0, default=0)
    length: int = at_least(0, default=PIECE)  # at most this many bytes (and PIECE)
    uuid: str = ""  # when set: that instance, else StaleDataset


@dataclasses.dataclass(frozen=True)
class ManifestPiece(Wire):
    name: str
    uuid: str
    piece: Piece
