"""Random trees split over random tar shards, and their real extraction: the merged tar view's
oracle (`NAME@untar`, kspeedfs.format.tarmerge). GNU tar extracts, shard after shard in path
order, each into its own folder: it replaces a file by unlinking it (a hard link to the old one
keeps the old bytes), as the view does; Python's tarfile would write through the link."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from treeutil import walk

from kspeedfs.format import tarmerge

FOLDERS = ["c0", "c1", "c1/sub", "c2/" + "d" * 120, "ünï"]
NAMES = ["x.jpg", "y.png", "z", "é.jpg", "f" * 150 + ".jpg"]
KINDS = ["file", "file", "file", "file", "symlink", "hardlink", "dir"]
SHARD_FOLDERS = ["", "", "part"]  # where a shard lies in the dataset: its members land there

# (shard, folder or None, name, kind, size): members of one folder spread over many shards,
# the same path in several shards, long names (GNU and PAX), nested folders, links.
member_st = st.tuples(
    st.integers(0, 5),
    st.one_of(st.none(), st.sampled_from(FOLDERS)),
    st.sampled_from(NAMES),
    st.sampled_from(KINDS),
    st.integers(0, 3000),
)
tree_st = st.lists(member_st, min_size=1, max_size=30)
shards_st = st.tuples(
    tree_st, st.lists(st.sampled_from(SHARD_FOLDERS), min_size=6, max_size=6), st.integers(0, 9)
)


def shard_tars(
    members: list[tuple[int, str | None, str, str, int]], places: list[str], seed: int
) -> dict[str, bytes]:
    """Path of each shard in the dataset -> its tar bytes. Symlinks and hard links get paths
    no other member has (GNU tar would follow a symlink on its path, and a path made both a
    folder and a file is refused by the view, not extracted); a hard link points at the last
    file its shard wrote before it."""
    per_shard: dict[int, list[tuple[int, str | None, str, str, int]]] = {}
    for k, (s, folder, name, kind, size) in enumerate(members):
        per_shard.setdefault(s, []).append((k, folder, name, kind, size))
    out: dict[str, bytes] = {}
    for s, rows in sorted(per_shard.items()):
        buf = io.BytesIO()
        fmt = (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)[(s + seed) % 2]
        written: list[str] = []
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for k, folder, name, kind, size in rows:
                path = f"{folder}/{name}" if folder else name
                info = tarfile.TarInfo(path)
                info.mtime = 1_600_000_000 + k
                if kind == "dir":
                    info = tarfile.TarInfo((folder or "c0") + "/")
                    info.type, info.mode = tarfile.DIRTYPE, 0o750
                    tar.addfile(info)
                elif kind == "symlink":
                    info.name = f"{path}-sym{k}"
                    info.type, info.linkname = tarfile.SYMTYPE, f"../{name}-{k}"
                    tar.addfile(info)
                elif kind == "hardlink":
                    if written:
                        info.name = f"{path}-hard{k}"
                        info.type, info.linkname = tarfile.LNKTYPE, written[-1]
                        tar.addfile(info)
                else:
                    data = bytes((seed * 7 + k + i) % 251 for i in range(size))
                    info.size, info.mode = size, 0o755 if k % 5 == 0 else 0o644
                    tar.addfile(info, io.BytesIO(data))
                    written.append(path)
        place = places[s % len(places)]
        out[f"{place}/shard-{s:03d}.tar" if place else f"shard-{s:03d}.tar"] = buf.getvalue()
    return out


def write_shards(root: Path, tars: dict[str, bytes]) -> None:
    for rel, raw in tars.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(raw)


def extract_in_order(tars: dict[str, bytes], dest: Path, skip: set[str] = frozenset()) -> Path:
    """GNU tar extracts each shard, in path order, into its own folder under `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in sorted(tars, key=os.fsencode):
        into = dest / os.path.dirname(rel)
        into.mkdir(parents=True, exist_ok=True)
        if rel in skip:
            continue
        subprocess.run(
            ["tar", "-xf", "-", "-C", str(into), "--no-same-owner"],
            input=tars[rel],
            check=True,
            capture_output=True,
        )
    return dest


def tree_of(root: Path) -> dict[bytes, tuple[str, bytes]]:
    """Relative path -> (kind, bytes or link target), names as bytes."""
    return walk(root, bytes)


def merged_tree_of(
    tree: tarmerge.MergedTree, member_bytes: Any, top: int = 0
) -> dict[bytes, tuple[str, bytes]]:
    """The same dict from a merged table; `member_bytes(shard, offset, size)` reads a file."""
    out: dict[bytes, tuple[str, bytes]] = {}
    stack = [(top, b"")]
    while stack:
        row, prefix = stack.pop()
        for name, child in tree.children(row):
            path = prefix + name
            kind = int(tree.kind[child])
            if kind == tarmerge.DIR:
                out[path] = ("dir", b"")
                stack.append((child, path + b"/"))
            elif kind == tarmerge.LINK:
                out[path] = ("link", tree.target(child))
            else:
                out[path] = ("file", bytes(member_bytes(*tree.member(child))))
    return out
