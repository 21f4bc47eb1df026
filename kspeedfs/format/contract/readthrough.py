"""The read-through cache's ops (kspeedfs.node.readthrough): registering a source, filling
the segments readers miss, reads reported by readers, the readers' plan, and refreshing from
the source."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kspeedfs.format.contract import Request, Wire, at_least, checked, dataset_name
from kspeedfs.format.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class RegisterSource(Request["Registered"]):
    """Create (or find) the read-through dataset `name` of `source` (an absolute folder or a
    URL; the node checks which, it knows the source schemes)."""

    OP = "register_source"
    source: str
    name: str = dataset_name()
    endpoint: str = ""
    # Bytes the dataset may take in memory and on the spill folder (0: no cap); set when the
    # dataset is created, refused when larger than what the node has free.
    max_memory: int = at_least(0, default=0)
    max_disk: int = at_least(0, default=0)
    # Its floor in memory, which no other dataset's miss and no preload takes (0: none), and
    # its weight in the max-min shares of what the uncapped datasets share.
    min_memory: int = at_least(0, default=0)
    weight: int = at_least(1, default=1)

    def limits(self) -> dict[str, int]:
        """What the new dataset's manifest header keeps of these (defaults left out)."""
        return {
            key: value
            for key in LIMITS
            if (value := getattr(self, key)) != RegisterSource.__dataclass_fields__[key].default
        }


LIMITS = (
    "max_memory",
    "max_disk",
    "min_memory",
    "weight",
)  # a read-through dataset's, in its header


@dataclasses.dataclass(frozen=True)
class Registered(Wire):
    """Where the dataset stands: "scanning" while it is listed, then as `progress` says."""

    name: str
    state: str
    lifetime: str | None = None  # once it is ready


@dataclasses.dataclass(frozen=True)
class FillSegment(Request["Filled"]):
    """Make segment `segment` of `name` resident on the node (of instance `uuid` when given)."""

    OP = "fill"
    name: str = dataset_name()
    segment: int = at_least(0)
    uuid: str = ""
    length: int = at_least(0, default=0)  # bytes the reader reads from the source if not kept


@dataclasses.dataclass(frozen=True)
class Filled(Wire):
    """ "cached": resident now; "filling": not yet, ask again; "failed": read it yourself;
    "source": not kept (the dataset's share is full): read it from the source, verified."""

    state: Literal["cached", "filling", "failed", "source"]
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Touch(Request["Touched"]):
    """A reader's report: these segments of `name` were read, `hits` times in all (the node's
    eviction policy cannot see reads through a map)."""

    OP = "touch"
    name: str = dataset_name()
    segments: list[int] = at_least(0)
    uuid: str = ""
    hits: int = at_least(0, default=0)


@dataclasses.dataclass(frozen=True)
class Touched(Wire):
    known: bool  # False: the node no longer has this instance


MAX_READER = 32  # characters of a PlanReq's `reader` ("rank/replicas" takes at most 21)


def _reader(reader: str) -> str:
    if len(reader) > MAX_READER:
        raise InvalidArgument(f"must be at most {MAX_READER} characters, not {len(reader)}")
    if not reader.isprintable():
        raise InvalidArgument("must be printable")
    return reader


@dataclasses.dataclass(frozen=True)
class PlanReq(Request["Planned"]):
    """Part of the upcoming segment order of `reader` (a rank's share of the sampler, as
    "rank/replicas"; "": the only reader) of instance `uuid` of `name`: `segments` go at
    position `start` of a plan of `total` uses that `plan` names (the workers of one rank
    send the same plan; the node takes it once it is whole, in place of that reader's older
    one)."""

    OP = "plan"
    plan: str
    name: str = dataset_name()
    segments: list[int] = at_least(0)
    total: int = at_least(0)
    start: int = at_least(0, default=0)
    uuid: str = ""
    horizon: int = at_least(0, default=0)  # uses in one epoch of it (0: half the plan)
    reader: str = checked(_reader, default="")


@dataclasses.dataclass(frozen=True)
class Planned(Wire):
    used: bool  # False: the node's policy does not use plans (eviction is not "plan")
    complete: bool = False  # the plan is whole on the node


@dataclasses.dataclass(frozen=True)
class Refresh(Request["Refreshed"]):
    """List the source of `name` again; a new instance when it changed."""

    OP = "refresh"
    name: str = dataset_name()


@dataclasses.dataclass(frozen=True)
class Refreshed(Wire):
    name: str
    state: Literal["unchanged", "refreshed"]
    changed: int  # files changed at the source
    kept: int  # segments carried over to the new instance (unchanged: all)
    segments: int  # of the instance served now
