"""A new read-through instance, staged from a listing of its source: its manifest and side
files, and (on a refresh) the old instance's segments whose contents did not change."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np

from kspeedfs.client.catalog import ListedInstance
from kspeedfs.format.contract import READTHROUGH
from kspeedfs.format.layout import Layout
from kspeedfs.format.localdata import EPOCH_FILE, MANIFEST_FILE, SEGSUMS_FILE, segment_path
from kspeedfs.format.manifest import plan_layout, write_manifest
from kspeedfs.format.tree import Tree
from kspeedfs.node.preload import tree_digest
from kspeedfs.node.readthrough.dataset import CachedDataset, base_bytes
from kspeedfs.node.safedir import link_segment
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources import version
from kspeedfs.sources.source import Source


def catalog_fields(meta: dict[str, Any]) -> ListedInstance:
    """What the catalog record of a read-through instance says once it is listed (from the
    store's record of it)."""
    return ListedInstance(
        uuid=meta["uuid"],
        members=tuple(meta["members"]),
        segments=meta["segments"],
        files=meta["files"],
        bytes=meta["bytes"],
        segment_size=meta["segment_size"],
        created=meta["created"],
    )


class InstanceBuilder:
    """Stages instances in the store (blocking: run it in a worker thread)."""

    def __init__(self, store: SegmentStore, segment_size: int, address: str):
        self.store = store
        self.segment_size = segment_size
        self.address = address

    def build(
        self,
        name: str,
        src: Source,
        tree: Tree,
        old: CachedDataset | None,
        uid: str = "",
        members: list[str] | None = None,
        caps: dict[str, int] | None = None,
    ) -> tuple[Path, dict[str, Any], dict[int, int]]:
        """A staging folder for a new instance (`uid`, placed over `members`: this node alone
        by default) and its record; with `old`, its segments whose contents are unchanged are
        carried over (hard links: no copy, no memory), and its caps. Returns the carried
        segments too, old -> new."""
        if caps is None:
            caps = old.limits() if old else {}
        segment_size = self.segment_size
        offsets, seg_len = plan_layout(tree, segment_size)
        header = {
            "name": name,
            "uuid": uid or secrets.token_hex(16),
            "source": src.url,
            "endpoint": src.endpoint,
            "segment_size": segment_size,
            "created": time.time(),
            "members": members or [self.address],
            "replicas": 1,
            "readthrough": True,
            "digest": tree_digest(tree),
            "versions": version.digest(tree),
            # In the manifest: members that adopt it and the instances a refresh makes keep them.
            **{k: v for k, v in caps.items() if v},
        }
        staging = self.store.new_staging(name)
        carried: dict[int, int] = {}
        try:
            write_manifest(
                staging / MANIFEST_FILE,
                tree,
                offsets,
                [0] * len(tree),
                seg_len,
                [0] * len(seg_len),
                header,
            )
            sums = np.zeros(len(seg_len), dtype="<u8")
            if old is not None:
                carried = self._carry(
                    old, tree, Layout.of_tree(tree, offsets, seg_len, segment_size)
                )
                for o, n in carried.items():
                    sums[n] = old.sums[o]
                    if o in old.resident:
                        try:
                            link_segment(segment_path(old.record.path, o), segment_path(staging, n))
                        except OSError:  # evicted meanwhile: from the spill, else read again
                            if o not in old.places.spilled:
                                sums[n] = 0
            sums.tofile(staging / SEGSUMS_FILE)
            (staging / EPOCH_FILE).write_bytes(bytes(8))
            base = base_bytes(staging)
        except BaseException:
            self.store.discard_staging(staging)
            raise
        meta = {
            **header,
            "lifetime": READTHROUGH,
            "files": tree.file_count,
            "bytes": tree.data_bytes,
            "segments": len(seg_len),
            "held": [],
            "stored": base,
        }
        return staging, meta, carried

    def adopted(self, name: str, blob: bytes, meta: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        """A staging folder for another member's instance from its manifest `blob`, holding no
        segment, and its record."""
        staging = self.store.new_staging(name)
        try:
            segments = int(meta["segments"])
            (staging / MANIFEST_FILE).write_bytes(blob)
            np.zeros(segments, dtype="<u8").tofile(staging / SEGSUMS_FILE)
            (staging / EPOCH_FILE).write_bytes(bytes(8))
            base = base_bytes(staging)
        except BaseException:
            self.store.discard_staging(staging)
            raise
        return staging, {**meta, "lifetime": READTHROUGH, "held": [], "stored": base}

    def _carry(self, old: CachedDataset, tree: Tree, layout: Layout) -> dict[int, int]:
        """Old segments (in memory, on the disk tier or spilled) whose exact contents reappear
        in the new layout."""
        have = {
            old.layout.signature(old.manifest, k): k
            for k in range(old.manifest.segments)
            if old.holds(k) or k in old.places.spilled
        }
        out = {}
        for n in range(layout.segments):
            o = have.get(layout.signature(tree, n))
            if o is not None:
                out[o] = n
        return out
