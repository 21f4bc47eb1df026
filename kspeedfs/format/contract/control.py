"""The op of the etcd control plane (kspeedfs.node.control): adopting an instance the catalog
holds now (`rebalance` is answered by the node: contract.node)."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire, dataset_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adopt(Request["Adopted"]):
    """Take the catalog's ready instance `uuid` of dataset `name` now, not at the next sync."""

    OP = "adopt"
    name: str = dataset_name()
    uuid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adopted(Wire):
    name: str
    adopted: bool  # this node lists that instance now
