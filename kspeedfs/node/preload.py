"""A distributed preload's plan: the scan, its layout in segments and its digest, and where
each segment goes; made once by the coordinator (node/coordinator.py) and carried to every
step, its digest checked by every member's stager (node/stager.py)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import stat

import xxhash

from kspeedfs.format import placement
from kspeedfs.format.contract.preload import Preload, Tier
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.layout import Layout
from kspeedfs.format.manifest import plan_layout
from kspeedfs.format.tree import Tree
from kspeedfs.node import metaindexes, sourceio
from kspeedfs.sources.source import is_url, open_source

# The largest manifest a member (or the catalog) takes, in pieces.
MAX_MANIFEST_BYTES = 1 << 34


def tree_digest(tree: Tree) -> str:
    """Identifies a scan: every member must see the same files with the same sizes. A
    folder's size counts as 0 (as scans before they recorded it): it changes with its names."""
    h = xxhash.xxh3_128()
    for name, parent, mode, size, mtime in zip(
        tree.names, tree.parent, tree.mode, tree.size, tree.mtime_ns, strict=True
    ):
        size = 0 if stat.S_ISDIR(mode) else size
        h.update(b"%d\0%d\0%d\0%d\0" % (parent, mode, size, mtime) + name + b"\0")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """A scan's layout in segments, worked out once: where each file's bytes go (`offsets`),
    each segment's length, and the two as a Layout the loaders read from."""

    offsets: list[int]
    seg_len: list[int]
    layout: Layout


def lay_out(tree: Tree, segment_size: int) -> LaidOut:
    offsets, seg_len = plan_layout(tree, segment_size)
    return LaidOut(offsets, seg_len, Layout.of_tree(tree, offsets, seg_len, segment_size))


@dataclasses.dataclass
class Plan:
    """A preload as its coordinator planned it: the scan, its layout and digest, and where
    each segment goes; computed once and carried to every step."""

    name: str
    uuid: str
    source: str
    lifetime: str
    replicas: int
    segment_size: int
    tree: Tree
    laid: LaidOut
    digest: str
    members: list[str]
    assignment: dict[str, list[int]]
    endpoint: str = ""  # object store endpoint of a URL source
    metas: list[str] = dataclasses.field(default_factory=list)  # meta files to index
    tier: Tier = "auto"  # where members place their segments
    max_memory: int = 0  # the most of each member's memory its segments take (0: no cap)
    max_disk: int = 0  # and of its disk tier

    def caps(self) -> dict[str, int]:
        return {"max_memory": self.max_memory, "max_disk": self.max_disk}


async def plan_preload(request: Preload, segment_size: int, live_members: list[str]) -> Plan:
    source = request.source
    if not (os.path.isabs(source) or is_url(source)):
        raise InvalidArgument("source must be an absolute path or a URL")
    if not request.replicas <= len(live_members):
        raise InvalidArgument(
            f"replicas must be between 1 and the {len(live_members)} live nodes,"
            f" not {request.replicas}"
        )
    src = open_source(source, request.endpoint)
    tree = await sourceio.run_sync(src.scan)
    laid = lay_out(tree, segment_size)
    placed = placement.Placement(request.name, len(laid.seg_len), live_members, request.replicas)
    return Plan(
        name=request.name,
        uuid=secrets.token_hex(16),
        source=source,
        lifetime=request.lifetime or "offline",
        replicas=request.replicas,
        segment_size=segment_size,
        tree=tree,
        laid=laid,
        digest=tree_digest(tree),
        members=list(live_members),
        assignment=placed.assignment(),
        endpoint=request.endpoint,
        metas=metaindexes.requested(request.meta, tree),
        tier=request.tier,
        max_memory=request.max_memory,
        max_disk=request.max_disk,
    )
