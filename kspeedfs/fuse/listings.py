"""A dataset folder's READDIRPLUS and READDIR replies, packed once for all its entries.

A folder's children are one run of the manifest's arrays (sorted by name), so the whole reply
stream, a `fuse_entry_out` plus a `fuse_dirent` and the padded name per entry, is built with a
few numpy operations and no Python per entry. Serving a request is then a slice of that buffer:
from the entry at the kernel's offset to the last one that fits its size (`PackedListing`), and
a LOOKUP of a name whose folder is packed is the entry's first 128 bytes. The fields are those
`Attr.pack_entry` writes (kernel.py) for `KSpeedFS._attr` of the same entry; the tests hold the
two equal, so a change to one must be made to the other.
"""

from __future__ import annotations

import stat

import numpy as np

from kspeedfs.format.manifest import Manifest
from kspeedfs.fuse.kernel import DIRENT, ENTRY_OUT, PackedListing

_TIMES = [("atime", "<i8"), ("mtime", "<i8"), ("ctime", "<i8")]
_NSECS = [("atimensec", "<u4"), ("mtimensec", "<u4"), ("ctimensec", "<u4")]
ENTRY_DTYPE = np.dtype(
    [("nodeid", "<u8"), ("generation", "<u8"), ("entry_valid", "<u8"), ("attr_valid", "<u8")]
    + [("entry_valid_nsec", "<u4"), ("attr_valid_nsec", "<u4")]
    + [("ino", "<u8"), ("size", "<u8"), ("blocks", "<u8"), *_TIMES, *_NSECS]
    + [("mode", "<u4"), ("nlink", "<u4"), ("uid", "<u4"), ("gid", "<u4"), ("rdev", "<u4")]
    + [("blksize", "<u4"), ("flags", "<u4")]
)
DIRENT_DTYPE = np.dtype([("d_ino", "<u8"), ("off", "<u8"), ("namelen", "<u4"), ("type", "<u4")])
assert ENTRY_DTYPE.itemsize == ENTRY_OUT.size and DIRENT_DTYPE.itemsize == DIRENT.size
PLUS_DTYPE = np.dtype([("entry", ENTRY_DTYPE), ("dirent", DIRENT_DTYPE)])
S_IFMT = 0o170000


def shown_modes(mode: np.ndarray, source_access: bool) -> np.ndarray:
    """`filesystem.shown_mode` over an array of modes."""
    mode = mode.astype(np.int64)
    fmt = mode & S_IFMT
    open_ = (fmt == stat.S_IFDIR) | ((mode & 0o111) != 0)
    shown = mode & ~0o222 if source_access else fmt | np.where(open_, 0o555, 0o444)
    return np.where(fmt == stat.S_IFLNK, mode, shown).astype("<u4")


def pack_folder(
    m: Manifest,
    folder: int,
    slot_base: int,
    plus: bool,
    source_access: bool,
    uid: int,
    gid: int,
    timeout: int,
    blksize: int,
) -> PackedListing:
    """Every reply entry of folder `folder` (a manifest index), inodes `slot_base | idx + 1`,
    entry and attribute timeouts of `timeout` whole seconds."""
    kids = m.children(folder)
    lo, hi = kids.start, kids.stop
    n = hi - lo
    idx = np.arange(lo, hi, dtype="<u8")
    mode = np.asarray(m.mode[lo:hi], dtype="<u4")
    shown = shown_modes(mode, source_access)
    inos = idx + np.uint64(1) + np.uint64(slot_base)
    head = np.zeros(n, dtype=PLUS_DTYPE if plus else DIRENT_DTYPE)
    dirent = head["dirent"] if plus else head
    dirent["d_ino"] = inos
    dirent["off"] = np.arange(1, n + 1, dtype="<u8")
    name_len = np.asarray(m.name_len[lo:hi], dtype=np.int64)
    dirent["namelen"] = name_len
    dirent["type"] = (shown >> 12) & 0xF
    if plus:
        e = head["entry"]
        e["nodeid"] = inos
        e["entry_valid"] = e["attr_valid"] = timeout
        e["ino"] = inos
        size = np.asarray(m.size[lo:hi], dtype="<u8")
        e["size"] = size
        e["blocks"] = (size + np.uint64(511)) // np.uint64(512)
        sec = np.asarray(m.mtime_s[lo:hi], dtype=np.int64)
        nsec = np.asarray(m.mtime_nsec[lo:hi], dtype="<u4")
        for f in ("atime", "mtime", "ctime"):
            e[f] = sec
        for f in ("atimensec", "mtimensec", "ctimensec"):
            e[f] = nsec
        e["mode"] = shown
        e["nlink"] = np.where((mode & S_IFMT) == stat.S_IFDIR, 2, 1)
        if source_access:
            e["uid"] = m.uid[lo:hi]
            e["gid"] = m.gid[lo:hi]
        else:
            e["uid"], e["gid"] = uid, gid
        e["blksize"] = blksize
    fixed = head.dtype.itemsize
    padded = (name_len + 7) & ~7
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(fixed + padded, out=starts[1:])
    # One row per record, as wide as the longest: the fixed part, then the name (zeros after
    # it); the records are then each row's first `fixed + padded` bytes, in row order (a
    # boolean mask over the grid), which costs a few passes over the grid and no index array
    # per byte.
    longest = int(name_len.max()) if n else 0
    grid = np.zeros((n, fixed + ((longest + 7) & ~7)), dtype=np.uint8)
    grid[:, :fixed] = head.view(np.uint8).reshape(n, fixed)
    if longest:
        cols = np.arange(longest, dtype=np.int64)
        at = np.asarray(m.name_off[lo:hi], dtype=np.int64)[:, None] + cols
        names = m.names[np.minimum(at, len(m.names) - 1)]
        names[cols >= name_len[:, None]] = 0
        grid[:, fixed : fixed + longest] = names
    out = grid[np.arange(grid.shape[1]) < (fixed + padded)[:, None]]
    return PackedListing(out.tobytes(), starts, ENTRY_OUT.size if plus else 0)
