"""Sources are read beneath their root: a component swapped for a symlink is never followed."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, wait_for
from rt_util import mount_source

from kspeedfs.format.errors import SourceChanged, StaleDataset
from kspeedfs.format.layout import Layout, plan_layout
from kspeedfs.sources.scan import scan_tree
from kspeedfs.sources.source import LocalSource

pytestmark = pytest.mark.slow  # read-through mounts over swapped source folders

SECRET = b"private bytes " * 300
PUBLIC = b"public bytes! " * 300


def _plant(tmp_path: Path, depth: int) -> tuple[Path, Path, bytes]:
    """src/d0/../f.bin with public bytes, and a private copy of the same folders whose f.bin
    has the same size and times but other bytes; returns (src, private, relpath)."""
    parts = [f"d{k}" for k in range(depth)]
    src, private = tmp_path / "src", tmp_path / "private"
    for root, data in ((src, PUBLIC), (private, SECRET)):
        folder = root.joinpath(*parts)
        folder.mkdir(parents=True)
        (folder / "f.bin").write_bytes(data)
    st = os.stat(src.joinpath(*parts, "f.bin"))
    os.utime(private.joinpath(*parts, "f.bin"), ns=(st.st_atime_ns, st.st_mtime_ns))
    return src, private, os.fsencode("/".join([*parts, "f.bin"]))


def _swap(src: Path, private: Path, component: str) -> None:
    """Replace src/COMPONENT by a symlink to the private folder of the same name."""
    shutil.rmtree(src / component)
    os.symlink(private / component, src / component)


@pytest.mark.parametrize("depth,component", [(1, "d0"), (3, "d0"), (3, "d0/d1"), (3, "d0/d1/d2")])
def test_swapped_component_is_not_followed(tmp_path: Path, depth: int, component: str) -> None:
    src_dir, private, rel = _plant(tmp_path, depth)
    src = LocalSource(str(src_dir))
    tree = scan_tree(src_dir)
    i = next(k for k in range(len(tree)) if tree.path(k) == rel)
    size = tree.size[i]
    offsets, seg_len = plan_layout(tree, 1 << 20)
    layout = Layout.of_tree(tree, offsets, seg_len, 1 << 20)
    _swap(src_dir, private, component)

    with pytest.raises(StaleDataset):
        src.read_verified(tree, i, 0, size)
    with pytest.raises(SourceChanged):
        src.checksum(tree, i)
    out = bytearray(int(seg_len[0]))
    with pytest.raises(SourceChanged):
        src.fill(tree, layout, 0, memoryview(out))
    assert SECRET[:64] not in out
    # Filled with sendfile into a segment file: the same refusal.
    seg = tmp_path / "seg"
    seg.write_bytes(bytes(len(out)))
    with open(seg, "r+b") as f, mmap.mmap(f.fileno(), 0) as m, memoryview(m) as view:
        with pytest.raises(SourceChanged):
            src.fill(tree, layout, 0, view, fd=f.fileno())
    assert SECRET[:64] not in seg.read_bytes()
    # A new scan lists the swapped folder as a link out of the tree: left out.
    again = scan_tree(src_dir)
    assert all(again.path(k) != rel for k in range(len(again)))


def test_only_symlinks_that_stay_inside_are_listed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"x")
    os.symlink("a/f", src / "inside")
    os.symlink("../a/f", src / "a" / "up-and-in")
    os.symlink("../../private", src / "a" / "out")
    os.symlink("..", src / "parent")
    os.symlink("/etc/passwd", src / "absolute")
    tree = scan_tree(src)
    paths = {tree.path(k) for k in range(len(tree))}
    assert {b"inside", b"a/up-and-in", b"a/f"} <= paths
    assert not paths & {b"a/out", b"parent", b"absolute"}


def test_preload_does_not_follow_a_swapped_folder(node: NodeProcess, tmp_path: Path) -> None:
    src_dir, private, _rel = _plant(tmp_path, 2)
    (src_dir / "kept.bin").write_bytes(PUBLIC)
    _swap(src_dir, private, "d0")
    node.request("preload", name="swapped", source=str(src_dir))
    wait_for(lambda: node.request("progress", name="swapped")["state"] == "ready")
    seg_dir = node.shm_dir / "datasets" / "swapped" / "seg"
    held = b"".join(p.read_bytes() for p in sorted(seg_dir.iterdir()))
    assert PUBLIC in held and SECRET[:64] not in held


@pytest.mark.fuse
def test_read_through_after_a_swap_reads_nothing_outside(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src_dir, private, rel = _plant(tmp_path, 2)
    m = mount_source(node, tmp_path, mounts, src_dir)
    path = m.mountpoint / os.fsdecode(rel)
    assert path.stat().st_size == len(PUBLIC)  # listed before the swap
    _swap(src_dir, private, "d0/d1")
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    assert SECRET[:64] not in data
    seg_root = node.shm_dir / "datasets"
    for seg in seg_root.rglob("seg/*"):
        assert SECRET[:64] not in seg.read_bytes()
