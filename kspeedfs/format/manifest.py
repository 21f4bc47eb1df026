"""The manifest: one immutable, memory-mapped record of a dataset's tree, layout and checksums.

Compact arrays (no Python object per file) in one file, so that every process on a node maps
the same pages read-only. Layout: an 8-byte magic, a u32 header length, a JSON header, then
64-byte aligned little-endian arrays whose offsets the header lists.

Format 2 added each entry's owner (`uid`, `gid`, from the scan's lstat) beside its mode, so that
the mount can answer with the source's permissions. A format 1 manifest (written before) still
reads, its entries owned by 0/0: never more open than the source was (the modes are kept, so
"others" keep exactly their access, and the owner's and group's bits go to root alone);
preloading the dataset again records the real owners.

Format 3 added the rest of each file's version (`ctime_ns`, `ident`, `dev`: see
`kspeedfs.sources.version`), which every copy from the source is checked against; in older
manifests they read as 0 ("not recorded": size, mtime and the root's device are checked).

Format 4 keeps each time as signed 64-bit seconds and 32-bit nanoseconds (`mtime_s`,
`mtime_nsec`, `ctime_s`, `ctime_nsec`): every time a Linux filesystem can hold (tmpfs holds
any 64-bit second, ext4 1901 to 2446), where signed 64-bit nanoseconds end in 1677 and 2262.
Older manifests' `mtime_ns`/`ctime_ns` read as the same two columns. Format 4 also records a
folder's size as the source reported it (what `du -sb` adds up); older manifests read 0 there.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kspeedfs.format.errors import DataError, NotFound
from kspeedfs.format.layout import Layout
from kspeedfs.format.layout import plan_layout as plan_layout  # where callers import it from
from kspeedfs.format.tree import Tree

MAGIC = b"KSPDMAN1"
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
NS = 1_000_000_000
_ALIGN = 64

# name -> dtype; every per-entry array has one row per entry.
ENTRY_ARRAYS = {
    "parent": "<u4",
    "mode": "<u4",
    "uid": "<u4",
    "gid": "<u4",
    "size": "<u8",  # file: its bytes; folder: what the source reported; link: its target's
    "mtime_s": "<i8",
    "mtime_nsec": "<u4",
    "data": "<u8",  # file: offset in the dataset's byte stream; folder: first child; link: name blob
    "count": "<u4",  # folder: number of children
    "name_off": "<u8",
    "name_len": "<u4",
    "checksum": "<u8",  # xxh3_64 of a file's bytes
    "ctime_s": "<i8",
    "ctime_nsec": "<u4",
    "ident": "<u8",  # inode, or an object's ETag hash
    "dev": "<u8",  # 0: the source root's device
}
SEGMENT_ARRAYS = {"seg_len": "<u8", "seg_checksum": "<u8"}
# Arrays added by a format, read as 0 from manifests written before it.
ADDED_IN = {2: ("uid", "gid"), 3: ("ctime_ns", "ident", "dev")}
# Formats 1 to 3 kept each time as signed 64-bit nanoseconds.
LEGACY_ARRAYS = {"mtime_ns": "<i8", "ctime_ns": "<i8"}


def write_manifest(
    path: str | os.PathLike[str],
    tree: Tree,
    offsets: list[int],
    checksums: list[int],
    seg_len: list[int],
    seg_checksums: list[int],
    header: dict[str, Any],
) -> None:
    n, n_seg = len(tree), len(seg_len)
    names = bytearray()
    name_off = np.zeros(n, dtype="<u8")
    name_len = np.zeros(n, dtype="<u4")
    data = np.array(offsets, dtype="<u8")
    for i, name in enumerate(tree.names):
        name_off[i], name_len[i] = len(names), len(name)
        names += name
    for i, target in tree.link_target.items():
        data[i] = len(names)
        names += target
    for i, mode in enumerate(tree.mode):
        if stat.S_ISDIR(mode):
            data[i] = tree.first_child[i]
    arrays: dict[str, np.ndarray] = {
        "parent": np.array(tree.parent, dtype="<u4"),
        "mode": np.array(tree.mode, dtype="<u4"),
        "uid": np.array(tree.uid, dtype="<u4"),
        "gid": np.array(tree.gid, dtype="<u4"),
        "size": np.array(tree.size, dtype="<u8"),
        **_seconds_and_nanoseconds("mtime", tree.mtime_ns),
        "data": data,
        "count": np.array(tree.child_count, dtype="<u4"),
        "name_off": name_off,
        "name_len": name_len,
        "checksum": np.array(checksums, dtype="<u8"),
        **_seconds_and_nanoseconds("ctime", tree.ctime_ns),
        "ident": np.array(tree.ident, dtype="<u8"),
        "dev": np.array(tree.dev, dtype="<u8"),
        "seg_len": np.array(seg_len, dtype="<u8"),
        "seg_checksum": np.array(seg_checksums, dtype="<u8"),
        "names": np.frombuffer(bytes(names), dtype="u1"),
    }
    write_arrays(path, arrays, dict(header, format=FORMAT_VERSION, entries=n, segments=n_seg))


def write_arrays(
    path: str | os.PathLike[str], arrays: dict[str, np.ndarray], header: dict[str, Any]
) -> None:
    """The manifest file of these arrays under this header (which names its format)."""
    # The header records offsets, which change the header's length: lay out twice.
    layout: dict[str, list[Any]] = {}
    for _ in range(2):
        blob = json.dumps(dict(header, arrays=layout), sort_keys=True).encode()
        pos = _align(len(MAGIC) + 4 + len(blob) + 256)
        layout = {}
        for key, arr in arrays.items():
            layout[key] = [pos, arr.dtype.str, int(arr.size)]
            pos = _align(pos + arr.nbytes)
    blob = json.dumps(dict(header, arrays=layout), sort_keys=True).encode()
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(blob)) + blob)
        for key, arr in arrays.items():
            f.seek(layout[key][0])
            f.write(arr.tobytes())
        f.truncate(pos)
    os.replace(tmp, path)


def _seconds_and_nanoseconds(key: str, times_ns: list[int]) -> dict[str, np.ndarray]:
    """`KEY_s` and `KEY_nsec` columns of times in nanoseconds (Python ints: any size)."""
    try:
        s, nsec = np.divmod(np.array(times_ns, dtype=np.int64), NS)  # floor, as Python's
    except OverflowError:  # a time past 1677-2262: each one as a Python int
        pairs = [divmod(t, NS) for t in times_ns]
        s = np.array([p[0] for p in pairs], dtype=np.int64)
        nsec = np.array([p[1] for p in pairs], dtype=np.int64)
    return {f"{key}_s": s.astype("<i8"), f"{key}_nsec": nsec.astype("<u4")}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Times:
    """A column of times kept as seconds and nanoseconds: `[i]` is entry i's time in
    nanoseconds as a Python int (no bound), as `os.stat_result.st_mtime_ns` gives it."""

    __slots__ = ("_nsec", "_s")

    def __init__(self, s: np.ndarray, nsec: np.ndarray):
        self._s, self._nsec = s.data, nsec.data

    def __getitem__(self, i: int) -> int:
        return int(self._s[i]) * NS + int(self._nsec[i])

    def __len__(self) -> int:
        return len(self._s)


class Manifest:
    """A read-only view of a manifest file; the arrays are views of one shared mapping."""

    def __init__(
        self, path: str | os.PathLike[str], dir_fd: int | None = None, fd: int | None = None
    ):
        """Map the manifest at `path` (relative to `dir_fd` when given: then the folder it is
        read from cannot be swapped under us by a rename), or the open file `fd` (one the node
        passed; `path` then only names it in messages)."""
        self.file = Path(path)
        try:
            if fd is not None:
                self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            else:
                with open(
                    self.file.name if dir_fd is not None else self.file,
                    "rb",
                    opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW, dir_fd=dir_fd),
                ) as f:
                    self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        except FileNotFoundError:
            raise NotFound(f"manifest not found: {self.file}") from None
        except (OSError, ValueError) as e:
            raise DataError(f"cannot map manifest {self.file}: {e}") from None
        try:
            self.header = self._parse_header()
            arrays = {
                key: np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
                for key, (offset, dtype, count) in self.header["arrays"].items()
            }
            n, nseg = int(self.header["entries"]), int(self.header["segments"])
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise DataError(f"corrupt manifest {self.file}: {e!r}") from None
        dtypes = ENTRY_ARRAYS | LEGACY_ARRAYS
        for version, keys in ADDED_IN.items():
            if self.header["format"] < version:
                for key in keys:  # one shared zero, no memory per entry
                    arrays[key] = np.broadcast_to(np.zeros(1, dtype=dtypes[key]), (n,))
        if self.header["format"] < 4:
            for key in ("mtime", "ctime"):
                ns = arrays.pop(f"{key}_ns", None)
                if ns is None or ns.size != n:
                    raise DataError(f"corrupt manifest {self.file}: {key}_ns has wrong length")
                s, nsec = np.divmod(ns, NS)
                arrays[f"{key}_s"], arrays[f"{key}_nsec"] = s, nsec.astype("<u4")
        for key in ENTRY_ARRAYS:
            if key not in arrays or arrays[key].size != n:
                raise DataError(f"corrupt manifest {self.file}: {key} has wrong length")
        for key in SEGMENT_ARRAYS:
            if arrays[key].size != nseg:
                raise DataError(f"corrupt manifest {self.file}: {key} has wrong length")
        self.parent = arrays["parent"]
        self.mode = arrays["mode"]
        self.uid = arrays["uid"]
        self.gid = arrays["gid"]
        self.size = arrays["size"]
        self.mtime_s = arrays["mtime_s"]
        self.mtime_nsec = arrays["mtime_nsec"]
        self.mtime_ns = Times(self.mtime_s, self.mtime_nsec)
        self.data = arrays["data"]
        self.count = arrays["count"]
        self.name_off = arrays["name_off"]
        self.name_len = arrays["name_len"]
        self.checksum = arrays["checksum"]
        self.ctime_s = arrays["ctime_s"]
        self.ctime_nsec = arrays["ctime_nsec"]
        self.ctime_ns = Times(self.ctime_s, self.ctime_nsec)
        self.ident = arrays["ident"]
        self.dev = arrays["dev"]
        self.seg_len = arrays["seg_len"]
        self.seg_checksum = arrays["seg_checksum"]
        self.names = arrays["names"]  # every name's bytes, at name_off (uint8)
        self._names_base = int(self.header["arrays"]["names"][0])
        self.segment_size: int = int(self.header["segment_size"])
        self.entries: int = n
        self.segments: int = nseg
        self.layout = Layout(self.data, self.size, self.mode, self.seg_len, self.segment_size)
        # Views of the columns that every FUSE lookup reads, indexed per request: a memoryview
        # gives a Python int in ~30 ns where a numpy array gives a numpy scalar in ~95.
        self._mode_at = self.mode.data
        self._size_at = self.size.data
        self._uid_at = self.uid.data
        self._gid_at = self.gid.data
        self._mtime_s_at = self.mtime_s.data
        self._mtime_nsec_at = self.mtime_nsec.data
        self._data_at = self.data.data
        self._count_at = self.count.data
        self._name_off_at = self.name_off.data
        self._name_len_at = self.name_len.data

    def _parse_header(self) -> dict[str, Any]:
        if self._map[: len(MAGIC)] != MAGIC:
            raise ValueError("bad magic")
        (length,) = struct.unpack_from("<I", self._map, len(MAGIC))
        start = len(MAGIC) + 4
        if start + length > len(self._map):
            raise ValueError("header runs past the end")
        header: dict[str, Any] = json.loads(self._map[start : start + length])
        if header.get("format") not in READABLE_VERSIONS:
            raise ValueError(f"unsupported format {header.get('format')!r}")
        return header

    @property
    def uuid(self) -> str:
        return str(self.header["uuid"])

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def name(self, i: int) -> bytes:
        off = self._names_base + self._name_off_at[i]
        return self._map[off : off + self._name_len_at[i]]

    def link_target(self, i: int) -> bytes:
        off = self._names_base + int(self.data[i])
        return self._map[off : off + int(self.size[i])]

    def is_dir(self, i: int) -> bool:
        return stat.S_ISDIR(self._mode_at[i])

    def is_file(self, i: int) -> bool:
        return stat.S_ISREG(self._mode_at[i])

    def is_link(self, i: int) -> bool:
        return stat.S_ISLNK(self._mode_at[i])

    def stat_fields(self, i: int) -> tuple[int, int, int, int, int]:
        """(mode, size, uid, gid, mtime_ns) of entry i, as Python ints."""
        return (
            self._mode_at[i],
            self._size_at[i],
            self._uid_at[i],
            self._gid_at[i],
            self._mtime_s_at[i] * NS + self._mtime_nsec_at[i],
        )

    def children(self, i: int) -> range:
        if not self.is_dir(i):
            return range(0)
        first = self._data_at[i]
        return range(first, first + self._count_at[i])

    def lookup(self, dir_idx: int, name: bytes) -> int | None:
        """Binary search among a folder's children (sorted by name bytes). Written out with
        locals: it runs on every FUSE lookup, about log2(folder size) steps."""
        kids = self.children(dir_idx)
        lo, hi = kids.start, kids.stop
        names, base, name_off, name_len = (
            self._map,
            self._names_base,
            self._name_off_at,
            self._name_len_at,
        )
        while lo < hi:
            mid = (lo + hi) // 2
            off = base + name_off[mid]
            mid_name = names[off : off + name_len[mid]]
            if mid_name < name:
                lo = mid + 1
            elif mid_name > name:
                hi = mid
            else:
                return mid
        return None

    def resolve(self, relpath: str | bytes) -> int:
        """Entry index of a path relative to the dataset root (no symlinks followed)."""
        raw = os.fsencode(relpath)
        idx = 0
        for part in raw.split(b"/"):
            if part in (b"", b"."):
                continue
            found = self.lookup(idx, part)
            if found is None:
                raise NotFound(f"no such file in dataset: {os.fsdecode(raw)}")
            idx = found
        return idx

    def path(self, i: int) -> bytes:
        parts = []
        while i != 0:
            parts.append(self.name(i))
            i = int(self.parent[i])
        return b"/".join(reversed(parts))

    def iter_files(self) -> Iterator[int]:
        """Indices of regular files, in manifest (breadth-first, name-sorted) order."""
        yield from np.flatnonzero((self.mode & 0o170000) == stat.S_IFREG).tolist()

    def permits(self, uid: int, groups: Iterable[int], want: int) -> np.ndarray:
        """Per entry: whether uid (in `groups`) has the `want` bits (4 read, 1 search) of its
        class (owner, else group, else others), as the kernel decides; root has them all."""
        if uid == 0:
            return np.ones(self.entries, dtype=bool)
        owner = self.uid == uid
        group = ~owner & np.isin(self.gid, np.fromiter(groups, dtype="<u4"))
        shift = np.where(owner, 6, np.where(group, 3, 0)).astype("<u4")
        return ((self.mode >> shift) & want) == want

    def readable_files(self, uid: int, groups: Iterable[int]) -> np.ndarray:
        """Per entry: a regular file that uid could open for reading at the source (read on
        the file, search on every folder above it), by the recorded modes and owners."""
        groups = list(groups)
        search = self.permits(uid, groups, 1)
        reachable = np.zeros(self.entries, dtype=bool)
        # Breadth-first order: a folder's parent comes before it.
        for d in np.flatnonzero((self.mode & 0o170000) == stat.S_IFDIR).tolist():
            reachable[d] = search[d] and (d == 0 or reachable[int(self.parent[d])])
        is_file = (self.mode & 0o170000) == stat.S_IFREG
        return is_file & self.permits(uid, groups, 4) & reachable[self.parent]

    def segments_holding(self, entries: np.ndarray) -> np.ndarray:
        """Per segment: whether it holds bytes of any entry where `entries` (a bool per entry)
        is true."""
        pick = entries & (self.size > 0) & ((self.mode & 0o170000) == stat.S_IFREG)
        first = self.data[pick] // self.segment_size
        last = (self.data[pick] + self.size[pick] - 1) // self.segment_size
        marks = np.zeros(self.segments + 1, dtype=np.int64)
        np.add.at(marks, first.astype(np.int64), 1)
        np.add.at(marks, last.astype(np.int64) + 1, -1)
        return np.cumsum(marks[:-1]) > 0

    def ranges(
        self, i: int, offset: int = 0, length: int | None = None
    ) -> list[tuple[int, int, int]]:
        """(segment, offset in segment, length) pieces for bytes [offset, offset+length) of file i."""
        return self.layout.ranges(i, offset, length)
