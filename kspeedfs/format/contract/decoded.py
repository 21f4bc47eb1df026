"""The ops of decoded variants (kspeedfs.node.decoded): start one on every member, fill it on
one, drop it, and what the members hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from kspeedfs.format.contract import Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.errors import InvalidArgument


def check_size(size: Any) -> int:
    """A variant's size (0: the images as they are). Here, not in format.decoded, so that the
    contract (which every CLI call imports) does not pull numpy and PIL in with it."""
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= 65535:
        raise InvalidArgument(f"decoded size must be an int from 0 to 65535, not {size!r}")
    return size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decode(Request["DecodeStarted"]):
    """Start the variant of `size` on every member of the dataset (uuid: of that instance)."""

    OP = "decode"
    name: str = dataset_name()
    size: int = checked(check_size)
    uuid: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeLocal(Request["VariantProgress"]):
    """Fill the variant of the images this member holds (a coordinator's call)."""

    OP = "decode_local"
    name: str = dataset_name()
    size: int = checked(check_size)
    uuid: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeDrop(Request["DecodeDropped"]):
    """Stop and remove the variant on this member (another one refused it)."""

    OP = "decode_drop"
    name: str = dataset_name()
    size: int = checked(check_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeStatus(Request["MemberVariants | DatasetVariants"]):
    """The variants of a dataset: on this member (`local`), or on every member."""

    OP = "decode_status"
    name: str = dataset_name()
    local: bool = False

    def answer(self, msg: Mapping[str, Any]) -> MemberVariants | DatasetVariants:
        return MemberVariants.from_wire(msg) if self.local else DatasetVariants.from_wire(msg)


# A variant's fill on one member, from probing its images' headers to ready (or failed).
VariantState = Literal["probing", "filling", "ready", "failed"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariantProgress(Wire):
    """One variant on one member (decode_local's answer, and each variant a member lists):
    its state, images decoded of those it holds, the bytes it takes, seconds it has taken."""

    size: int
    state: VariantState
    error: str = ""
    files_total: int = at_least(0)
    files_done: int = at_least(0)
    undecodable: int = at_least(0)
    bytes: int = at_least(0)
    elapsed: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeStarted(Wire):
    """A variant started on every member of an instance: the images and bytes it takes over
    them all, and each member's part."""

    name: str
    uuid: str
    size: int
    files_total: int = at_least(0)
    bytes: int = at_least(0)
    nodes: dict[str, VariantProgress]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeDropped(Wire):
    """The member that stopped and removed a variant (or held none)."""

    node: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemberVariants(Wire):
    """The variants of a dataset on one member, by size (decode_status with `local`)."""

    node: str
    variants: dict[str, VariantProgress]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariantSummary(Wire):
    """One variant over the members: their counts added up, the worst state (and its error),
    and how many members answered for it."""

    size: int
    state: VariantState
    error: str = ""
    files_total: int = at_least(0, default=0)
    files_done: int = at_least(0, default=0)
    undecodable: int = at_least(0, default=0)
    bytes: int = at_least(0, default=0)
    nodes: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetVariants(Wire):
    """The variants of an instance on every member (decode_status): each member's answer
    ({size: VariantProgress's fields}, or {"error": why it did not answer}) and the summary
    by size."""

    name: str
    uuid: str
    nodes: dict[str, dict[str, Any]]
    variants: dict[str, VariantSummary]
