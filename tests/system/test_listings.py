"""Packed folder listings (fuse/listings.py): every reply equal to the one built entry by entry.

In process, over manifests of hypothesis trees (odd-byte names, empty folders, symlinks, modes
and owners of every kind, 10,000 entries in one folder), every (offset, size) a kernel may ask
and every LOOKUP; through a real mount, listings equal to the source with seekdir/telldir across
reply boundaries, and across an unload and a reload under the same name. The slow test walks
200,000 files in 200 folders through a fresh mount.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.format.manifest import Manifest, plan_layout, write_manifest
from kspeedfs.format.tree import Tree
from kspeedfs.fuse.datasets import SLOT_SHIFT, MountedDataset
from kspeedfs.fuse.filesystem import KSpeedFS
from kspeedfs.fuse.kernel import ROOT_INODE, pack_entries

SLOT = 3

names_st = st.binary(min_size=1, max_size=40).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b"..")
)
modes_st = st.sampled_from(
    [stat.S_IFREG | 0o644, stat.S_IFREG | 0o755, stat.S_IFREG | 0o600, stat.S_IFREG | 0o4711]
    + [stat.S_IFDIR | 0o755, stat.S_IFDIR | 0o700, stat.S_IFLNK | 0o777]
)
entry_st = st.tuples(
    modes_st,
    st.integers(0, 1 << 40),  # size
    st.integers(0, 1 << 62),  # mtime_ns
    st.integers(0, 1 << 31),  # uid
    st.integers(0, 1 << 31),  # gid
)
tree_st = st.recursive(
    st.dictionaries(names_st, entry_st, max_size=8),
    lambda kids: st.dictionaries(names_st, st.one_of(entry_st, kids), max_size=6),
    max_leaves=40,
)


def preload(node: NodeProcess, source: Path, name: str) -> None:
    done = run_cli("preload", str(source), "--name", name, "-q", env=node.env())
    assert done.returncode == 0, done.stderr


class NoSupervisor:
    def ask_refresh(self, force: bool, wait: float) -> None:
        pass

    def wait_invalidations(self, timeout: float) -> None:
        pass


def build_tree(spec: dict[bytes, Any]) -> Tree:
    """Breadth first, children sorted by name: a dict value is a folder."""
    t = Tree()
    t.append(b"", 0, stat.S_IFDIR | 0o755, 0, 7)
    queue: list[tuple[int, dict[bytes, Any]]] = [(0, spec)]
    while queue:
        idx, folder = queue.pop(0)
        t.first_child[idx] = len(t)
        t.child_count[idx] = len(folder)
        for name in sorted(folder):
            value = folder[name]
            if isinstance(value, dict):
                queue.append((len(t), value))
                t.append(name, idx, stat.S_IFDIR | 0o750, 0, 11, 5, 6)
                continue
            mode, size, mtime, uid, gid = value
            if stat.S_ISDIR(mode):
                queue.append((len(t), {}))  # an empty folder
                size = 0
            if stat.S_ISLNK(mode):
                t.link_target[len(t)] = b"target-" + name
                size = len(t.link_target[len(t)])
            t.append(name, idx, mode, size, mtime, uid, gid)
    return t


def manifest_of(tree: Tree, dest: Path) -> Manifest:
    files_only = Tree(**{**tree.__dict__, "size": [
        s if stat.S_ISREG(m) else 0 for s, m in zip(tree.size, tree.mode, strict=True)
    ]})  # fmt: skip
    offsets, seg_len = plan_layout(files_only, 1 << 60)
    write_manifest(
        dest,
        tree,
        offsets,
        [0] * len(tree),
        seg_len,
        [0] * len(seg_len),
        {"uuid": "u-1", "segment_size": 1 << 60, "name": "t"},
    )
    return Manifest(dest)


def filesystem(m: Manifest, access: str, single: bool = False) -> KSpeedFS:
    reader: Any = SimpleNamespace(settings=SimpleNamespace(access=access))
    fs = KSpeedFS(reader, NoSupervisor(), "t" if single else None)
    data: Any = SimpleNamespace(manifest=m, local=None)
    mounted = MountedDataset(SLOT, "t", "u-1", data)
    fs.by_slot, fs.by_name = {SLOT: mounted}, {"t": mounted}
    return fs


def check_equal(fs: KSpeedFS, m: Manifest, sizes: list[int]) -> None:
    """Every folder: every reply (each offset, each size) and every lookup."""
    for folder in np.flatnonzero((m.mode & 0o170000) == stat.S_IFDIR).tolist():
        ino = ROOT_INODE if folder == 0 and fs.single else (SLOT << SLOT_SHIFT) | (folder + 1)
        count = len(m.children(folder))
        for plus in (True, False):
            packed = fs.listing(ino, plus)
            assert packed is not None and len(packed) == count
            for offset in range(count + 2):
                for size in sizes:
                    expected = pack_entries(fs.entries(ino, offset), offset, size, plus)
                    assert bytes(packed.reply(offset, size)) == expected, (folder, offset, size)
        for child in m.children(folder):
            found = fs.lookup(ino, m.name(child))
            assert not hasattr(found, "pack_entry"), "the folder is packed: its entry is reused"
            assert bytes(found) == fs._attr(fs.by_slot[SLOT], child).pack_entry()  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=tree_st, access=st.sampled_from(["source", "open"]), single=st.booleans())
def test_packed_replies_equal_entry_by_entry(
    spec: dict[bytes, Any], access: str, single: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = manifest_of(build_tree(spec), tmp_path_factory.mktemp("m") / "m.ksm")
    check_equal(filesystem(m, access, single), m, [0, 1, 100, 180, 4096])


def test_ten_thousand_entries_in_one_folder(tmp_path: Path) -> None:
    spec = {b"n%05d-" % i + bytes([1 + i % 254]) * (i % 50): (
        stat.S_IFREG | 0o644, i, i * 1_000_000_007, i, i) for i in range(10_000)}  # fmt: skip
    m = manifest_of(build_tree(spec), tmp_path / "m.ksm")
    fs = filesystem(m, "open")
    ino = (SLOT << SLOT_SHIFT) | 1
    for plus in (True, False):
        packed = fs.listing(ino, plus)
        assert packed is not None and len(packed) == 10_000
        offset = 0
        replies = 0
        while True:  # the kernel's walk: each reply's end is the next offset
            part = bytes(packed.reply(offset, 4096))
            assert part == pack_entries(fs.entries(ino, offset), offset, 4096, plus)
            if not part:
                break
            offset += count_records(part, plus)
            replies += 1
        assert offset == 10_000 and replies > 100
    assert fs.listing(ino, True) is fs.listing(ino, True)  # built once, kept
    fs.drop(SLOT)
    assert not fs._listings


def count_records(reply: bytes, plus: bool) -> int:
    n = pos = 0
    fixed = 128 + 24 if plus else 24
    while pos < len(reply):
        namelen = int.from_bytes(reply[pos + fixed - 8 : pos + fixed - 4], "little")
        pos += fixed + ((namelen + 7) & ~7)
        n += 1
    return n


# ---- through a real mount (a node and a mount process: slow)

libc = ctypes.CDLL(None, use_errno=True)
libc.opendir.restype = ctypes.c_void_p
libc.opendir.argtypes = [ctypes.c_char_p]
libc.readdir.restype = ctypes.c_void_p
libc.readdir.argtypes = [ctypes.c_void_p]
libc.telldir.restype = ctypes.c_long
libc.telldir.argtypes = [ctypes.c_void_p]
libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
libc.closedir.argtypes = [ctypes.c_void_p]
D_NAME = 19  # offsetof(struct dirent, d_name) on Linux x86-64 and arm64


def dir_names(path: bytes) -> list[tuple[int, bytes]]:
    """(telldir before the entry, name) for every entry, through libc's readdir."""
    d = libc.opendir(path)
    assert d, os.strerror(ctypes.get_errno())
    out = []
    try:
        while True:
            pos = libc.telldir(d)
            ent = libc.readdir(d)
            if not ent:
                return out
            out.append((pos, ctypes.string_at(ent + D_NAME)))
    finally:
        libc.closedir(d)


def names_after_seek(path: bytes, pos: int, count: int) -> list[bytes]:
    d = libc.opendir(path)
    try:
        libc.readdir(d)  # something read first, so the seek goes back or forward for real
        libc.seekdir(d, pos)
        out = []
        for _ in range(count):
            ent = libc.readdir(d)
            if not ent:
                break
            out.append(ctypes.string_at(ent + D_NAME))
        return out
    finally:
        libc.closedir(d)


def odd_tree(root: Path, big: int, tag: bytes) -> None:
    base = os.fsencode(root)
    os.makedirs(os.path.join(base, b"big"))
    for i in range(big):  # long names: a listing of many replies
        with open(os.path.join(base, b"big", b"%05d-" % i + tag * 60), "wb") as f:
            f.write(b"x" * (i % 7))
    os.makedirs(os.path.join(base, b"raw-\xff\xfe", b"empty"))
    with open(os.path.join(base, b"raw-\xff\xfe", b"\x01\x7f\xe9" + tag), "wb") as f:
        f.write(tag)
    os.symlink(b"big", os.path.join(base, b"link-" + tag))


def listed(root: bytes) -> dict[bytes, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(dirpath, name)
            st_ = os.lstat(full)
            kind = stat.S_IFMT(st_.st_mode)  # a folder's size is not the source's (du differs)
            out[os.path.relpath(full, root)] = (kind, 0 if kind == stat.S_IFDIR else st_.st_size)
    return out


@pytest.mark.slow
@pytest.mark.fuse
def test_mount_listings_seekdir_and_a_reload(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = tmp_path / "src"
    odd_tree(src, 3000, b"a")
    preload(node, src, "odd")
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    m.start()
    served = os.fsencode(m.mountpoint / "odd")
    assert listed(served) == listed(os.fsencode(src))
    big = os.path.join(served, b"big")
    entries = dir_names(big)
    names = [n for _, n in entries if n not in (b".", b"..")]
    assert names == sorted(os.listdir(os.path.join(os.fsencode(src), b"big")))
    stats = json.loads(os.getxattr(m.mountpoint, "user.kspeedfs.stats"))
    assert stats["readdirplus"] > 10  # many replies: the seeks below cross their boundaries
    for k in (0, 1, 2, 499, 500, 1234, 2999, len(entries) - 1):
        pos, name = entries[k]
        assert names_after_seek(big, pos, 40) == [n for _, n in entries[k : k + 40]]
    # Unloaded and loaded again under the same name from a changed source: the new listing.
    assert run_cli("unload", "odd", env=node.env()).returncode == 0
    shutil.rmtree(src)
    odd_tree(src, 2000, b"b")
    preload(node, src, "odd")
    wait_for(lambda: os.path.exists(os.path.join(served, b"link-b")), 20, "the new instance")
    assert listed(served) == listed(os.fsencode(src))


@pytest.mark.slow
@pytest.mark.fuse
def test_walk_of_200000_files_through_a_fresh_mount(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = tmp_path / "src"
    for d in range(200):
        folder = src / f"n{d:08d}"
        folder.mkdir(parents=True)
        for i in range(1000):
            with open(folder / f"n{d:08d}_{i}.JPEG", "wb") as f:
                f.write(b"x" * (i % 3))
    preload(node, src, "walk")
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    m.start()
    before = json.loads(os.getxattr(m.mountpoint, "user.kspeedfs.stats"))
    got = listed(os.fsencode(m.mountpoint / "walk"))
    after = json.loads(os.getxattr(m.mountpoint, "user.kspeedfs.stats"))
    assert len(got) == 200_200
    assert got == listed(os.fsencode(src))
    # Names and sizes came with the listings: no LOOKUP per file.
    assert after.get("lookup", 0) - before.get("lookup", 0) < 1000
