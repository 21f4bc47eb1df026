"""Decoded variants on the mount: `NAME@N/` shows a dataset's tree with each image a binary PPM.

Each image file `stem.ext` (ImageFolder's extensions) is shown as `stem.ppm` (as `stem.ext.ppm`
when several images of one folder share the stem), whose bytes are the PPM the node stored: a
short header, then the uint8 HWC pixels of `Resize(N)(pil_loader(path))`, which PIL opens
without decoding. Other files appear unchanged. A variant folder is an instance of its own in
the mount's tables (a slot numbered by the supervisor, sharing the dataset's manifest), so its
inodes mean the same in every worker and it is forgotten with the instance.

Where a sample comes from: READY in this node's variant index, a view of the mapped segment
(header and pixels in one piece, no copy); UNDECODABLE, the original bytes (PIL identifies a
file by its content, not its name, so ImageFolder fails on it exactly as on the original).
Anything else (not decoded yet while the fill runs, held by another node, no local variant) is
decided here on demand with the node's own rule (`decoded.decode_checked`): decoded by this
process when looked up, kept in a small cache for the reads that follow. Listings give such a
file no lasting attributes (timeout 0), so the kernel looks it up, and so decides it, before
it is opened: the size it then reports is final, PPM or original, as the node's fill would make
it.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import decoded as fmt
from kspeedfs.format import tarview
from kspeedfs.format.contract.node import DatasetEntry
from kspeedfs.format.errors import DataError, KSpeedError, NotFound
from kspeedfs.fuse.kernel import Buffer, FuseError, ReadResult
from kspeedfs.system.local_dataset import LocalDataset

log = logging.getLogger(__name__)

PPM = b".ppm"
DECIDED_BYTES = 64 << 20  # per process: PPMs decoded here, kept for the reads that follow
SHOWN_STATES = ("filling", "ready")  # a variant whose index is written


@dataclasses.dataclass(frozen=True)
class ViewOf:
    """A folder that shows dataset `base` another way (what the supervisor sends with it):
    its decoded variant at `size`, or (size None) its tar view."""

    base: str
    size: int | None = None


def folder_name(name: str, size: int) -> str:
    return f"{name}@{size}"


def offered(ready: dict[str, DatasetEntry]) -> dict[str, tuple[str, int]]:
    """The variant folders a node's listing of ready datasets offers: {NAME@N: (NAME, N)}."""
    out: dict[str, tuple[str, int]] = {}
    for name, d in ready.items():
        for size, v in d.decoded.items():
            if v.state in SHOWN_STATES:
                out[folder_name(name, int(size))] = (name, int(size))
    return out


def top_names(manifest: Any) -> set[bytes]:
    """The names a variant shows at its root (VariantFiles.name of each top-level entry), for
    a mount that serves NAME@N at its root."""
    kids = [int(c) for c in manifest.children(0)]
    stems: dict[bytes, int] = {}
    for c in kids:
        base = stem(manifest.name(c)) if manifest.is_file(c) else None
        if base is not None:
            stems[base] = stems.get(base, 0) + 1
    out = set()
    for c in kids:
        name = manifest.name(c)
        base = stem(name) if manifest.is_file(c) else None
        out.add(name if base is None else base + PPM if stems[base] == 1 else name + PPM)
    return out


def stem(name: bytes) -> bytes | None:
    """`a.b` of an image named `a.b.jpg`; None for a name that is not an image's."""
    if not fmt.is_image(name):
        return None
    return name[: name.rindex(b".")]


class VariantFiles:
    """One variant folder as a serving process shows it: names, sizes and bytes per entry of
    the dataset's manifest."""

    def __init__(self, reader: ClusterReader, data: DatasetHandle, size: int):
        self.reader = reader
        self.data = data
        self.size = size
        self.manifest = data.manifest
        self.local = _open_local(data, size)
        self._decided: OrderedDict[int, bytes | None] = OrderedDict()  # None: undecodable
        self._decided_bytes = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        with self._lock:
            self._decided.clear()
            self._decided_bytes = 0

    # ---- names

    def is_image(self, idx: int) -> bool:
        m = self.manifest
        return m.is_file(idx) and fmt.is_image(m.name(idx))

    def name(self, idx: int) -> bytes:
        """The name entry `idx` is shown under."""
        m = self.manifest
        name = m.name(idx)
        base = stem(name) if m.is_file(idx) else None
        if base is None:
            return name
        if len(self._images_with_stem(int(m.parent[idx]), base)) == 1:
            return base + PPM
        return name + PPM

    def lookup(self, parent: int, name: bytes) -> int | None:
        """The entry shown as `name` in folder `parent`."""
        m = self.manifest
        if name.endswith(PPM):
            base = name[: -len(PPM)]
            same = self._images_with_stem(parent, base)
            if len(same) == 1:
                return same[0]
            original = m.lookup(parent, base)  # `stem.ext.ppm`: a stem shared by several
            if original is not None and self.is_image(original):
                shared = stem(base)
                if shared is not None and len(self._images_with_stem(parent, shared)) > 1:
                    return original
            return None
        found = m.lookup(parent, name)
        if found is not None and self.is_image(found):
            return None  # an image is shown under its .ppm name only
        return found

    def _images_with_stem(self, parent: int, base: bytes) -> list[int]:
        """The image files of folder `parent` named `base.EXT` (children are sorted by name,
        so the names starting with `base.` are one run)."""
        m = self.manifest
        prefix = base + b"."
        kids = m.children(parent)
        lo, hi = kids.start, kids.stop
        while lo < hi:
            mid = (lo + hi) // 2
            if m.name(mid) < prefix:
                lo = mid + 1
            else:
                hi = mid
        out = []
        while lo < kids.stop:
            name = m.name(lo)
            if not name.startswith(prefix):
                break
            if b"." not in name[len(prefix) :] and self.is_image(lo):
                out.append(lo)
            lo += 1
        return out

    # ---- sizes and bytes

    def file_size(self, idx: int, decide: bool) -> tuple[int, bool]:
        """(size shown, final): final sizes are for good; a size not final (a listing's, before
        the entry is decided) must not be kept by the kernel."""
        m = self.manifest
        if not self.is_image(idx):
            return int(m.size[idx]), True
        state = self._state(idx)
        if state == fmt.READY:
            assert self.local is not None
            return self.local.stored_size(idx), True
        if state == fmt.UNDECODABLE:
            return int(m.size[idx]), True
        with self._lock:
            known = idx in self._decided
            ppm = self._decided.get(idx)
        if not known and decide:
            ppm = self._decide(idx)
            known = True
        if known:
            return (int(m.size[idx]) if ppm is None else len(ppm)), True
        if state == fmt.ABSENT:
            assert self.local is not None
            return self.local.stored_size(idx), False  # what it will be unless it fails
        return int(m.size[idx]), False

    def read(self, idx: int, offset: int, size: int) -> ReadResult | None:
        """The bytes shown for entry `idx`, or None: the original file's (the caller reads)."""
        if not self.is_image(idx):
            return None
        state = self._state(idx)
        if state == fmt.READY:
            assert self.local is not None
            return _clip(self.local.ppm(idx), offset, size)
        if state == fmt.UNDECODABLE:
            return None
        with self._lock:
            known = idx in self._decided
            ppm = self._decided.get(idx)
        if known:
            return None if ppm is None else _clip(ppm, offset, size)
        return self._deciding_read(idx, offset, size)

    def _deciding_read(self, idx: int, offset: int, size: int) -> Callable[[], Buffer]:
        def blocking_read() -> Buffer:
            ppm = self._decide(idx)
            if ppm is not None:
                return _clip(ppm, offset, size)
            return self._original(idx)[offset : offset + size]

        return blocking_read

    def _state(self, idx: int) -> int:
        return self.local.state(idx) if self.local is not None else fmt.NOT_HERE

    def _decide(self, idx: int) -> bytes | None:
        """Decode entry `idx` here: its PPM, or None when it does not decode."""
        img = fmt.decode_checked(self._original(idx), self.size)
        ppm = None if img is None else fmt.ppm_header(*img.size) + img.tobytes()
        with self._lock:
            if idx not in self._decided:
                self._decided[idx] = ppm
                self._decided_bytes += len(ppm or b"")
            while self._decided_bytes > DECIDED_BYTES and len(self._decided) > 1:
                _, old = self._decided.popitem(last=False)
                self._decided_bytes -= len(old or b"")
        return ppm

    def _original(self, idx: int) -> Buffer:
        """The original file's bytes (a view of the local segment where it is held here)."""
        local = self.data.local
        try:
            if isinstance(local, LocalDataset) and local.holds_file(idx):
                return local.file_view(idx)
            return self.reader.read(self.data, idx, 0, int(self.manifest.size[idx]))
        except KSpeedError as e:
            path = os.fsdecode(self.manifest.path(idx))
            log.error("cannot read %s/%s to decode it: %s", self.data.name, path, e)
            raise FuseError(errno.EIO) from None


def _open_local(data: DatasetHandle, size: int) -> fmt.DecodedVariant | None:
    """This node's variant index and pixels, when this process can map them."""
    local = data.local
    if not isinstance(local, LocalDataset):
        return None
    try:
        return fmt.DecodedVariant(local.path / fmt.variant_dir(size), data.uuid)
    except (NotFound, DataError) as e:
        log.info("%s@%d: no local decoded pixels, decoding here (%s)", data.name, size, e)
        return None


def _clip(data: Buffer, offset: int, size: int) -> memoryview:
    return memoryview(data)[offset : offset + size]


# ---- the tar view: `NAME@tar/`

TAR_SUFFIX = "@tar"
MAX_INDEX = (1 << 32) - 2  # an inode's entry part (inode = slot << 32 | index + 1)


def tar_folder_name(name: str) -> str:
    return f"{name}{TAR_SUFFIX}"


def tar_entries(manifest: Any) -> Any:
    """The manifest indices of the dataset's `.tar` files (numpy, in index order)."""
    m = manifest
    files = np.flatnonzero((np.asarray(m.mode) & 0o170000) == stat.S_IFREG)
    lens = np.asarray(m.name_len)[files].astype(np.int64)
    files, lens = files[lens >= 4], lens[lens >= 4]
    if not files.size:
        return files
    ends = np.asarray(m.name_off)[files].astype(np.int64) + lens
    tails = np.stack([m.names[ends - 4 + k] for k in range(4)], axis=1)
    return files[np.all(tails == np.frombuffer(b".tar", dtype=np.uint8), axis=1)]


class TarFiles:
    """`NAME@tar/` as a serving process shows it: the dataset's tree, each `.tar` file a
    folder of its members (format/tarview.py), parsed at its first use and kept.

    Indices below the manifest's entry count are the dataset's entries (a tar's is its
    folder); a tar's other nodes follow all of them, each tar a run of `node_span` numbers in
    manifest order, so that an index means the same in every process."""

    def __init__(self, reader: ClusterReader, data: DatasetHandle):
        self.reader = reader
        self.data = data
        self.manifest = m = data.manifest
        self.tars = tar_entries(m)
        spans = np.array([tarview.node_span(int(m.size[i])) - 1 for i in self.tars], np.int64)
        self.bases = m.entries + np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
        if int(self.bases[-1]) > MAX_INDEX:
            raise DataError(f"{data.name}: its tars are too large for one tar view")
        self._tar_at = {int(t): k for k, t in enumerate(self.tars)}
        self._trees: dict[int, tarview.TarTree | None] = {}  # by tar entry; None: refused
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._trees.clear()

    # ---- nodes

    def _tree(self, tar: int) -> tarview.TarTree | None:
        tree = self._trees.get(tar, False)
        if tree is not False:
            return tree  # type: ignore[return-value]
        size = int(self.manifest.size[tar])
        try:
            parsed: tarview.TarTree | None = tarview.parse(
                lambda off, n: self._raw(tar, off, n), size
            )
        except DataError as e:
            path = os.fsdecode(self.manifest.path(tar))
            log.error("%s@tar: %s is shown empty: %s", self.data.name, path, e)
            parsed = None
        with self._lock:
            self._trees.setdefault(tar, parsed)
            return self._trees[tar]

    def _raw(self, tar: int, offset: int, size: int) -> Buffer:
        """Bytes of the tar file (a view of the local segment where it is held here)."""
        local = self.data.local
        if local is not None:
            try:
                return local.read_view(tar, offset, size)
            except DataError:
                pass
        try:
            return self.reader.read(self.data, tar, offset, size)
        except KSpeedError as e:
            path = os.fsdecode(self.manifest.path(tar))
            log.error("cannot read %s/%s: %s", self.data.name, path, e)
            raise FuseError(errno.EIO) from None

    def is_tar(self, idx: int) -> bool:
        return idx in self._tar_at

    def locate(self, idx: int) -> tuple[int, tarview.TarTree, int] | None:
        """(tar entry, its tree, node) of an index past the manifest's, or of a tar's own
        entry (node 0); None for another of the dataset's entries, or a node not in its tar."""
        if idx < self.manifest.entries:
            if idx not in self._tar_at:
                return None
            tree = self._tree(idx)
            return None if tree is None else (idx, tree, 0)
        k = int(np.searchsorted(self.bases, idx, side="right")) - 1
        if k < 0 or k >= len(self.tars):
            raise FuseError(errno.ENOENT)
        tar = int(self.tars[k])
        tree = self._tree(tar)
        number = idx - int(self.bases[k]) + 1
        if tree is None or tree.node(number) is None:
            raise FuseError(errno.ENOENT)
        return tar, tree, number

    def index(self, tar: int, number: int) -> int:
        return tar if number == 0 else int(self.bases[self._tar_at[tar]]) + number - 1

    def stat_fields(self, idx: int) -> tuple[int, int, int, int, int] | None:
        """(mode, size, uid, gid, mtime_ns) of a node; None for the dataset's own entries
        (not tars), whose fields are the manifest's. Members take their tar's owners."""
        found = self.locate(idx)
        if found is None:
            if idx in self._tar_at:  # a refused tar: an empty folder
                _, _, uid, gid, mtime = self.manifest.stat_fields(idx)
                return stat.S_IFDIR | 0o555, 0, uid, gid, mtime
            return None
        tar, tree, number = found
        _, _, uid, gid, tar_mtime = self.manifest.stat_fields(tar)
        if number == 0:
            return stat.S_IFDIR | 0o555, 0, uid, gid, tar_mtime
        node = tree.nodes[number]
        size = node.size if node.kind == tarview.FILE else len(node.target)
        return tarview.shown_mode(node), size, uid, gid, node.mtime * 1_000_000_000

    def is_dir(self, idx: int) -> bool:
        if idx < self.manifest.entries and idx not in self._tar_at:
            return self.manifest.is_dir(idx)
        fields = self.stat_fields(idx)
        return fields is not None and stat.S_ISDIR(fields[0])

    def parent(self, idx: int) -> int:
        if idx < self.manifest.entries:
            return int(self.manifest.parent[idx])
        found = self.locate(idx)
        assert found is not None
        tar, tree, number = found
        return self.index(tar, tree.nodes[number].parent)

    def lookup(self, parent: int, name: bytes) -> int | None:
        if parent < self.manifest.entries and parent not in self._tar_at:
            return self.manifest.lookup(parent, name)
        found = self.locate(parent)
        if found is None:
            return None
        tar, tree, number = found
        child = tree.nodes[number].children.get(name)
        return None if child is None else self.index(tar, child)

    def children(self, idx: int) -> list[tuple[bytes, int]]:
        m = self.manifest
        if idx < m.entries and idx not in self._tar_at:
            return [(m.name(c), c) for c in m.children(idx)]
        found = self.locate(idx)
        if found is None:
            return []
        tar, tree, number = found
        return [(name, self.index(tar, c)) for name, c in tree.children(number)]

    def readlink(self, idx: int) -> bytes | None:
        found = self.locate(idx) if idx >= self.manifest.entries else None
        if found is None:
            return None  # the dataset's own: the manifest's
        _, tree, number = found
        node = tree.nodes[number]
        if node.kind != tarview.LINK:
            raise FuseError(errno.EINVAL)
        return node.target

    def shows_own_bytes(self, idx: int) -> bool:
        """A dataset file shown as it is (not a tar, not a member): its checksum holds."""
        return idx < self.manifest.entries and idx not in self._tar_at

    def read(self, idx: int, offset: int, size: int) -> ReadResult | None:
        """A member's bytes (a range of its tar); None for the dataset's own files."""
        if idx < self.manifest.entries:
            if idx in self._tar_at:
                raise FuseError(errno.EISDIR)
            return None
        found = self.locate(idx)
        assert found is not None
        tar, tree, number = found
        node = tree.nodes[number]
        if node.kind != tarview.FILE:
            raise FuseError(errno.EISDIR if node.kind == tarview.DIR else errno.EINVAL)
        n = max(0, min(size, node.size - offset))
        if n == 0:
            return b""
        local = self.data.local
        if local is not None:
            try:
                return local.read_view(tar, node.offset + offset, n)
            except DataError:
                pass
        return lambda: self._raw(tar, node.offset + offset, n)
