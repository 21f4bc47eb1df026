"""The ops of the node's integrity owner (node/scrub.py): damage a reader found."""

from __future__ import annotations

import dataclasses

from kspeedfs.format.contract import Request, Wire, at_least, dataset_name


@dataclasses.dataclass(frozen=True)
class ReportDamage(Request["DamageChecked"]):
    """Segments of a dataset's local copy whose bytes a reader found not the manifest's
    (flipped, cut short, grown): the node checks each itself, and quarantines and fetches
    again those that fail. Answers how many it found damaged."""

    OP = "report_damage"
    name: str = dataset_name()
    segments: list[int] = at_least(0)
    uuid: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DamageChecked(Wire):
    """How many of the reported segments the node found damaged (and quarantined)."""

    damaged: int = at_least(0)
