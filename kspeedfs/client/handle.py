"""A dataset as a reader sees it: its name, instance, manifest, members and local mapping."""

from __future__ import annotations

from dataclasses import dataclass, field

from kspeedfs.format import placement
from kspeedfs.format.manifest import Manifest
from kspeedfs.system.local_dataset import LocalDataset


@dataclass
class DatasetHandle:
    """What a reader needs to read one dataset: its manifest and where its segments are."""

    name: str
    uuid: str
    source: str
    members: list[str]
    replicas: int
    manifest: Manifest
    local: LocalDataset | None = None
    heals: bool = False  # a control plane re-creates lost copies (etcd): look for them too
    lost: list[str] = field(default_factory=list)  # members whose copies were made elsewhere
    _owners: dict[int, list[str]] = field(default_factory=dict)
    _placement: placement.Placement | None = None

    def owners(self, seg: int) -> list[str]:
        """Where to look for a segment, best first: its `replicas` placed owners, then, in a
        cluster that heals, as many members again by weight: where the copies of an owner that
        is lost (and not yet known here as lost) are re-created."""
        found = self._owners.get(seg)
        if found is None:
            if self._placement is None:
                self._placement = placement.Placement(
                    self.name, self.manifest.segments, self.members, self.replicas, self.lost
                )
            wanted = self.replicas * (2 if self.heals else 1)
            found = self._owners[seg] = self._placement.ranked(seg, wanted)
        return found

    @property
    def readthrough(self) -> bool:
        """Filled on demand by one node (its segments come and go), not placed and replicated."""
        return bool(self.manifest.header.get("readthrough"))
