"""One process's access to one dataset instance: zero-copy views where local, the one read
policy (ClusterReader) for the rest. The fast path and the fsspec filesystem both read this way.

Views are maps (a sealed disk-tier segment's too, each file checked once); reads that copy
(`scratch_view`, `fetch`, `gather`) read an unsealed segment of the node's disk tier with
pread instead (system/disk_copies). Views of unsealed memory segments are not kept across calls: each
call checks the segment's size first. Reads of a read-through dataset's segments
through the map are reported to the node (touches), which cannot see them."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader, count_hit, local_node_for
from kspeedfs.client.touches import TouchReporter
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import DatasetEntry
from kspeedfs.format.contract.readthrough import PlanReq
from kspeedfs.format.errors import DataError, InvalidArgument
from kspeedfs.format.manifest import Manifest
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.system.readthrough_view import ReadThroughDataset

PLAN_CHUNK = 65536  # segment uses per `plan` request: well inside a frame


@dataclasses.dataclass(frozen=True)
class CacheRef:
    """Picklable: what any process needs to open the same dataset again."""

    settings: Settings
    name: str
    uuid: str
    source: str
    info: DatasetEntry  # the node's listing entry (members, path, replicas, lifetime)
    local: bool | None  # None: map where possible; True: must map; False: always the network

    @property
    def key(self) -> tuple[str, str, bool | None]:
        return (self.name, self.uuid, self.local)


class Reader:
    """One process's access to one dataset: zero-copy views of local segments, network for the rest.

    Thread-safe for reads; the cluster reader pools one connection per thread in use.
    """

    def __init__(self, ref: CacheRef):
        self.ref = ref
        local_node = None if ref.local is False else local_node_for(ref.settings)
        self.cluster = ClusterReader(ref.settings, local_node)
        self.handle: DatasetHandle = self.cluster.open_dataset(ref.name, ref.info)
        if self.handle.uuid != ref.uuid:
            raise DataError(f"dataset {ref.name} was reloaded since this job attached to it")
        if ref.local is True and self.handle.local is None:
            raise InvalidArgument(
                f"dataset {ref.name} cannot be mapped by this process (local=True)"
            )
        self.manifest: Manifest = self.handle.manifest
        self.local = self.handle.local
        self.local_node = local_node
        # The hot path (cached segment views) only for a static dataset held whole here: the
        # segments of a read-through one come and go, and a cached view would pin them.
        self.all_local = (
            type(self.local) is LocalDataset and len(self.local.held) == self.manifest.segments
        )
        self._touches = (
            TouchReporter(self.cluster, local_node, self.handle)
            if isinstance(self.local, ReadThroughDataset) and local_node is not None
            else None
        )
        self._scratch = threading.local()
        self._seg_views: dict[int, memoryview] = {}
        self._disk_views: dict[int, memoryview] = {}  # sealed disk-tier segments' maps
        # The node's damage news (system/damage.py): one word of shared memory, and the
        # generation these views were kept in; news drops them (and the dataset's own maps).
        self._news = self.local.news.words if self.local is not None else None
        self._news_seen = self.local.listen() if self.local is not None else 0
        # The dataset's count of maps let go of when these views were kept (LocalDataset.dropped)
        self._dropped = self.local.dropped if self.local is not None else 0
        self._views_lock = threading.Lock()
        self._data = self.manifest.data
        self._size = self.manifest.size
        self._seg_size = self.manifest.segment_size

    def local_view(self, entry: int) -> memoryview:
        """`view` of a file when the whole dataset is local: the per-sample hot path."""
        start = int(self._data[entry])
        seg, off = divmod(start, self._seg_size)
        end = off + int(self._size[entry])
        assert self.local is not None
        if self._news is not None and self._news[0] != self._news_seen:
            self._news_seen = self.local.listen()
        if self.local.dropped != self._dropped:
            self._let_go()
        if end > self._seg_size:
            # Spans segments: joined. (It called view(), which came back here: a RecursionError
            # for every file over a segment boundary.)
            try:
                return self.local.file_view(entry)
            except DataError:
                return self._copied(entry)
        mv = self._seg_views.get(seg)
        if mv is None:
            dropped = self.local.dropped
            mv = self._disk_views.get(seg)  # (only disk-tier segments are in it)
            if mv is not None and self.local.disk.file_checked(entry):
                return mv[off:end]
            if seg in self.local.on_disk:
                return self._disk_view(entry, seg, off, end)
            try:
                mv = memoryview(self.local.segment(seg))
            except DataError:
                return self._copied(entry)  # unloaded before we mapped it: the read policy
            if not self.local.maps_sealed(seg):
                return mv[off:end]  # unsealed: its size is checked at each use (local_dataset)
            self._keep(self._seg_views, seg, mv, dropped)
        return mv[off:end]

    def _let_go(self) -> None:
        """The dataset let go of maps (damage news, damage found here, an unload): so do the
        kept views, which may be of them (the next read maps and checks again)."""
        assert self.local is not None
        with self._views_lock:
            dropped = self.local.dropped
            self._seg_views.clear()
            self._disk_views.clear()
            self._dropped = dropped

    def _keep(self, views: dict[int, memoryview], seg: int, mv: memoryview, dropped: int) -> None:
        """Keep `mv`, a map of `seg` got when the dataset had let go of `dropped` maps, unless
        it let go of one since (then `mv` may be the one it dropped)."""
        assert self.local is not None
        with self._views_lock:
            if self.local.dropped == dropped == self._dropped:
                views[seg] = mv

    def _disk_view(self, entry: int, seg: int, off: int, end: int) -> memoryview:
        """File `entry`, which lies on the disk tier: a view of its map where the segment is
        sealed (the immutable flag), else read with pread; checked against its checksum the
        first time (disk_copies). A damaged one is read elsewhere by the read policy."""
        assert self.local is not None
        dropped = self.local.dropped
        try:
            view = self.local.mapped_file(entry, seg, off, end)
            if view is not None:
                if self.all_local and self.local.maps_sealed(seg):
                    # Kept (the map just checked): its next files cost one test each.
                    self._keep(self._disk_views, seg, memoryview(view.obj), dropped)
                return view
            return memoryview(self.local.read(entry, 0, int(self._size[entry])))
        except DataError:
            return self._copied(entry)

    def range_view(self, entry: int, offset: int, length: int) -> memoryview | None:
        """Bytes [offset, offset+length) of file `entry` as a view of its mapped segment, when
        they lie in one segment held here (no copy); None: read them with `gather`."""
        local = self.local
        if local is None or self.handle.readthrough:
            return None  # a read-through segment may leave the map: the policy decides
        seg, off = divmod(int(self._data[entry]) + offset, self._seg_size)
        if off + length > self._seg_size or not local.holds(seg) or seg in local.on_disk:
            return None  # (disk-tier bytes are copied and checked: never a map)
        if self._news is not None and self._news[0] != self._news_seen:
            self._news_seen = local.listen()
        if local.dropped != self._dropped:
            self._let_go()
        mv = self._seg_views.get(seg) if self.all_local else None
        if mv is None:
            dropped = local.dropped
            try:
                mv = memoryview(local.segment(seg))
            except DataError:
                return None  # unloaded before we mapped it: the read policy finds another copy
            if self.all_local and local.maps_sealed(seg):
                self._keep(self._seg_views, seg, mv, dropped)
        return mv[off : off + length]

    def is_local(self, entry: int) -> bool:
        return self.all_local or (self.local is not None and self.local.holds_file(entry))

    def _mapped(self, entry: int) -> memoryview | None:
        """File `entry`'s bytes in shared memory; None when they are not local here."""
        if self.all_local:
            return self.local_view(entry)
        if self.is_local(entry):
            assert self.local is not None
            try:
                view = self.local.file_view(entry)
            except DataError:
                return None  # unloaded before we mapped it: the read policy finds another copy
            if self._touches is not None:
                count_hit(self.local)
                self._touches.note()
            return view
        return None

    def _copies_by_pread(self, entry: int) -> bool:
        """Whether file `entry` has bytes in a disk-tier segment this process has not mapped:
        a copy of them (pread) costs less than a map."""
        local = self.local
        return (
            local is not None
            and bool(local.on_disk)
            and any(
                local.disk.copies_by_pread(seg) for seg, _off, _n in self.manifest.ranges(entry)
            )
        )

    def view(self, entry: int) -> memoryview:
        """File `entry`'s bytes: a view of shared memory when local, else a fresh buffer."""
        mapped = self._mapped(entry)
        return mapped if mapped is not None else self._copied(entry)

    def _copied(self, entry: int) -> memoryview:
        out = bytearray(int(self.manifest.size[entry]))
        self.gather([(entry, 0, len(out))], memoryview(out))
        return memoryview(out)

    def scratch_view(self, entry: int) -> memoryview:
        """Like `view`, but remote bytes, and those of the disk tier, land in a reusable
        per-thread buffer (valid until the next call: for decoding right away)."""
        mapped = None if self._copies_by_pread(entry) else self._mapped(entry)
        if mapped is not None:
            return mapped
        n = int(self.manifest.size[entry])
        buf: bytearray | None = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = bytearray(max(n, 1 << 20))
        out = memoryview(buf)[:n]
        self.gather([(entry, 0, n)], out)
        return out

    def fetch(self, entries: Sequence[int]) -> dict[int, memoryview]:
        """Whole files, one vectored read per node; each entry's bytes are its own memory."""
        entries = list(dict.fromkeys(entries))
        sizes = [int(self.manifest.size[e]) for e in entries]
        buf = memoryview(bytearray(sum(sizes)))
        self.gather([(e, 0, n) for e, n in zip(entries, sizes, strict=True)], buf)
        out, pos = {}, 0
        for e, n in zip(entries, sizes, strict=True):
            out[e] = buf[pos : pos + n]
            pos += n
        return out

    def announce_plan(self, epochs: Sequence[np.ndarray], reader: str = "") -> None:
        """Tell the nodes that fill this read-through dataset the order `reader` (a rank's
        share of the sampler, "rank/replicas"; "": the only one) will read its files in, an
        array of manifest entries per epoch (this one and the next), as segment uses, in
        chunks; the same plan from another worker of that reader has the same name and is
        taken once, and a node keeps one plan per reader."""
        runs = [self._segment_uses(entries) for entries in epochs]
        segments = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
        if len(segments) == 0:
            return
        name = xxhash.xxh3_64_hexdigest(segments.tobytes())
        h = self.handle
        nodes = h.members if h.members else [self.local_node] if self.local_node else []
        for node in nodes:
            for start in range(0, len(segments), PLAN_CHUNK):
                request = PlanReq(
                    name=h.name,
                    uuid=h.uuid,
                    plan=name,
                    segments=segments[start : start + PLAN_CHUNK].tolist(),
                    total=len(segments),
                    start=start,
                    horizon=len(runs[0]),
                    reader=reader,
                )
                if not self.cluster.pool.call(node, request).used:
                    break  # this node's policy does not use plans

    def _segment_uses(self, entries: np.ndarray) -> np.ndarray:
        """The segments files `entries` start in, a run of files in one segment once."""
        starts = self.manifest.data[entries].astype(np.int64) // self._seg_size
        keep = np.ones(len(starts), dtype=bool)
        keep[1:] = starts[1:] != starts[:-1]
        return starts[keep]

    def gather(self, requests: Sequence[tuple[int, int, int]], out: memoryview) -> None:
        """Fill `out` with bytes [offset, offset+length) of each (entry, offset, length), back to
        back, by the cluster's one read policy (local copy, owners, verified source)."""
        self.cluster.gather(self.handle, requests, out)
        if self._touches is not None:
            self._touches.note()
