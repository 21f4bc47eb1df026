"""The ops of the etcd control plane (kspeedfs.node.control): adopting an instance the catalog
holds, and placing datasets over the members live now."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire, checked, dataset_name
from kspeedfs.format.names import validate_name


def _name_or_all(name: str) -> str:
    """A dataset's name, or "" for every dataset."""
    return validate_name(name) if name else ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adopt(Request):
    """Take the catalog's ready instance `uuid` of dataset `name` now, not at the next sync."""

    OP = "adopt"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adopted(Wire):
    name: str
    adopted: bool  # this node lists that instance now


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rebalance(Request):
    """Place one dataset (`name`), or every one (""), over the members live now."""

    OP = "rebalance"
    name: str = checked(_name_or_all, default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rebalanced(Wire):
    datasets: list[str]
    members: list[str]
