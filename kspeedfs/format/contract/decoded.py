"""The ops of decoded variants (kspeedfs.node.decoded): start one on every member, fill it on
one, drop it, and what the members hold."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, checked, dataset_name
from kspeedfs.format.decoded import check_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decode(Request):
    """Start the variant of `size` on every member of the dataset (uuid: of that instance)."""

    OP = "decode"
    name: str = dataset_name()
    size: int = checked(check_size)
    uuid: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeLocal(Request):
    """Fill the variant of the images this member holds (a coordinator's call)."""

    OP = "decode_local"
    name: str = dataset_name()
    size: int = checked(check_size)
    uuid: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeDrop(Request):
    """Stop and remove the variant on this member (another one refused it)."""

    OP = "decode_drop"
    name: str = dataset_name()
    size: int = checked(check_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeStatus(Request):
    """The variants of a dataset: on this member (`local`), or on every member."""

    OP = "decode_status"
    name: str = dataset_name()
    local: bool = False
