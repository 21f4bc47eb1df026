"""A dataset as a reader sees it: its name, instance, manifest, members and local mapping."""

from __future__ import annotations

from dataclasses import dataclass, field

from kspeedfs.format import placement
from kspeedfs.format.localdata import LocalDataset
from kspeedfs.format.manifest import Manifest


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
    _owners: dict[int, list[str]] = field(default_factory=dict)

    def owners(self, seg: int) -> list[str]:
        """Where to look for a segment, best first: its `replicas` placed owners, then as many
        nodes again in rendezvous order, which is where a cluster that healed the copies of a
        lost owner put them (placement over the members left picks exactly those)."""
        found = self._owners.get(seg)
        if found is None:
            found = self._owners[seg] = placement.owners(
                self.name, seg, self.members, 2 * self.replicas
            )
        return found

    @property
    def readthrough(self) -> bool:
        """Filled on demand by one node (its segments come and go), not placed and replicated."""
        return bool(self.manifest.header.get("readthrough"))
