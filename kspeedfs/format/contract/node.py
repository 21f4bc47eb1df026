"""The ops NodeServer itself answers: liveness and what the node holds."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kspeedfs.format.contract import Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.contract.pieces import PIECE, BlobPiece
from kspeedfs.format.names import validate_name


@dataclasses.dataclass(frozen=True)
class Ping(Request):
    OP = "ping"


@dataclasses.dataclass(frozen=True)
class Pong(Wire):
    node: str
    version: int


@dataclasses.dataclass(frozen=True)
class ManifestReq(Request):
    """A piece of a published dataset's manifest (a client or member that holds none of it
    fetches the whole file piece by piece, with kspeedfs.format.contract.pieces.fetch_all)."""

    OP = "manifest"
    name: str = dataset_name()
    offset: int = at_least(0, default=0)
    length: int = at_least(0, default=PIECE)  # at most this many bytes (and PIECE)
    uuid: str = ""  # when set: that instance, else StaleDataset


@dataclasses.dataclass(frozen=True)
class ManifestPiece(Wire):
    name: str
    uuid: str
    piece: BlobPiece


@dataclasses.dataclass(frozen=True)
class Status(Request):
    """What the node holds and does: budget, datasets, connections, subsystems."""

    OP = "status"


@dataclasses.dataclass(frozen=True)
class List(Request):
    """Every dataset the node holds or is loading."""

    OP = "list"


@dataclasses.dataclass(frozen=True)
class Unload(Request):
    """Unload a dataset on every member (or cancel its load, or forget its failure)."""

    OP = "unload"
    name: str = dataset_name()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unloaded(Wire):
    """What an unload did: "unloaded" (`bytes` freed, on this member for unload_local),
    "absent" (unload_local: this member held no part of that instance), "cancelled" (a load
    under way was stopped) or "forgotten" (a failed load's record dropped)."""

    name: str
    state: Literal["unloaded", "absent", "cancelled", "forgotten"]
    bytes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True)
class UnloadLocal(Request):
    """Unload this member's part of a dataset (of instance `uuid` only, when given)."""

    OP = "unload_local"
    name: str = dataset_name()
    uuid: str = ""


@dataclasses.dataclass(frozen=True)
class Shutdown(Request):
    OP = "shutdown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stopping(Wire):
    """The node that was asked to shut down, stopping."""

    node: str
    state: Literal["stopping"] = "stopping"


def _name_or_all(value: str) -> str:
    return validate_name(value) if value else value


@dataclasses.dataclass(frozen=True)
class Rebalance(Request):
    """Control plane: place one dataset (or every one, with no name) over the live members."""

    OP = "rebalance"
    name: str = checked(_name_or_all, default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rebalanced(Wire):
    """The datasets placed again, and the members they were placed over."""

    datasets: list[str]
    members: list[str]
