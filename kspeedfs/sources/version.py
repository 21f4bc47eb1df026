"""A source file's version as its listing records it, and the one check that a copy has it.

A version is (size, mtime_ns, ctime_ns, ident, dev): for a folder's file, `ident` is its inode
and `dev` its device (0 when it is the root's device, so that the same shared folder mounted
on another node, with another device number, reads as the same file); for an object, `ident`
is a hash of its ETag or version id. Every copy of source bytes into the cache checks the file
before and after it (`check`): a file that is not at the listed version on both sides may be
torn, and the copy is thrown away. ctime catches a writer that restores mtime. A zero ctime or
ident means "not recorded" (manifests older than format 3, objects with no ETag).
"""

from __future__ import annotations

import os

import xxhash

from kspeedfs.format.errors import SourceModified
from kspeedfs.format.layout import FileTable
from kspeedfs.format.tree import Tree

Version = tuple[int, int, int, int, int]


def of_stat(st: os.stat_result, root_dev: int) -> Version:
    """The version an lstat or fstat of a file beneath a root on device root_dev says."""
    dev = 0 if st.st_dev == root_dev else st.st_dev
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, dev


def tag_ident(tag: object) -> int:
    """An object's ETag or version id as an ident (0: none; never 0 otherwise)."""
    text = str(tag or "").strip('"')
    return (xxhash.xxh3_64_intdigest(text.encode()) or 1) if text else 0


def listed(files: FileTable, i: int) -> Version:
    """The version the listing (a scanned Tree or a manifest) recorded for entry i."""
    return (
        int(files.size[i]),
        int(files.mtime_ns[i]),
        int(files.ctime_ns[i]),
        int(files.ident[i]),
        int(files.dev[i]),
    )


def digest(tree: Tree) -> str:
    """Identifies the part of a scan's versions that names, sizes and mtimes leave out (every
    entry's ctime, ident and dev): a file rewritten with its mtime put back changes it."""
    h = xxhash.xxh3_128()
    for ctime, ident, dev in zip(tree.ctime_ns, tree.ident, tree.dev, strict=True):
        h.update(b"%d\0%d\0%d\0" % (ctime, ident, dev))
    return h.hexdigest()


def difference(want: Version, got: Version) -> str:
    """How `got` differs from the listed `want` ("" when it is that version)."""
    if got[0] != want[0]:
        return "shorter" if got[0] < want[0] else "longer"
    if got[1] != want[1] or (want[2] and got[2] != want[2]):
        return "modified"
    if (want[3] and got[3] != want[3]) or got[4] != want[4]:
        return "replaced"
    return ""


def check(want: Version, got: Version, display: str, when: str) -> None:
    """SourceModified ("source changed WHEN (how): FILE") unless got is the listed version."""
    how = difference(want, got)
    if how:
        raise SourceModified(f"source changed {when} ({how}): {display}")
