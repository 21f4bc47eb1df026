"""The Source interface: verified failover reads refuse a file that is not the listed one; fills
and the layout put every byte where the packed stream says."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.format.errors import StaleDataset
from kspeedfs.format.layout import Layout, plan_layout
from kspeedfs.format.tree import Tree
from kspeedfs.sources.source import FsspecSource, LocalSource, Source, open_source

SIZE = 300_000


def _source(kind: str, root: Path) -> Source:
    return LocalSource(str(root)) if kind == "local" else FsspecSource(f"file://{root}")


@pytest.fixture(params=["local", "fsspec"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def one_file(tmp_path: Path) -> tuple[Path, bytes]:
    root = tmp_path / "src"
    root.mkdir()
    data = os.urandom(SIZE)
    (root / "f.bin").write_bytes(data)
    return root, data


def _listed(src: Source, relpath: bytes) -> tuple[Tree, int]:
    """The source's scan and the file's entry in it (what a manifest records)."""
    tree = src.scan()
    return tree, next(i for i in range(len(tree)) if tree.path(i) == relpath)


def test_partial_read_of_an_unchanged_file_is_exact(
    kind: str, one_file: tuple[Path, bytes]
) -> None:
    root, data = one_file
    src = _source(kind, root)
    tree, i = _listed(src, b"f.bin")
    assert src.read_verified(tree, i, 1000, 131072) == data[1000:132072]
    # Past the end: only the bytes the file has, never an error.
    assert src.read_verified(tree, i, SIZE - 10, 4096) == data[-10:]
    assert src.read_verified(tree, i, SIZE, 4096) == b""
    whole = xxhash.xxh3_64_intdigest(data)
    assert src.read_verified(tree, i, 0, SIZE, whole) == data


def test_same_size_other_mtime_is_stale(kind: str, one_file: tuple[Path, bytes]) -> None:
    root, data = one_file
    src = _source(kind, root)
    tree, i = _listed(src, b"f.bin")
    before = (root / "f.bin").stat().st_mtime_ns
    (root / "f.bin").write_bytes(bytes(reversed(data)))
    os.utime(root / "f.bin", ns=(before, before + 1_000_000_000))
    with pytest.raises(StaleDataset, match="source file changed since preload"):
        src.read_verified(tree, i, 0, 4096)


def test_shrunk_file_is_stale_not_short(kind: str, one_file: tuple[Path, bytes]) -> None:
    root, data = one_file
    src = _source(kind, root)
    tree, i = _listed(src, b"f.bin")
    before = (root / "f.bin").stat().st_mtime_ns
    with open(root / "f.bin", "r+b") as f:
        f.truncate(68_928)
    os.utime(root / "f.bin", ns=(before, before))  # even with the old time put back
    with pytest.raises(StaleDataset):
        src.read_verified(tree, i, 0, 131072)


def test_removed_file_is_stale(kind: str, one_file: tuple[Path, bytes]) -> None:
    root, _data = one_file
    src = _source(kind, root)
    tree, i = _listed(src, b"f.bin")
    (root / "f.bin").unlink()
    with pytest.raises(StaleDataset):
        src.read_verified(tree, i, 0, 10)


def test_whole_file_with_a_wrong_checksum_is_stale(kind: str, one_file: tuple[Path, bytes]) -> None:
    root, data = one_file
    src = _source(kind, root)
    tree, i = _listed(src, b"f.bin")
    wrong = xxhash.xxh3_64_intdigest(data) ^ 1
    with pytest.raises(StaleDataset, match="checksum"):
        src.read_verified(tree, i, 0, SIZE, wrong)
    # A part of the file cannot be checked against a whole-file checksum: it is served.
    assert src.read_verified(tree, i, 0, SIZE - 1, wrong) == data[:-1]


def test_a_last_component_replaced_by_a_symlink_is_refused(one_file: tuple[Path, bytes]) -> None:
    root, data = one_file
    src = LocalSource(str(root))
    tree, i = _listed(src, b"f.bin")
    # The link points at a file with the very same bytes and times: only the link is wrong.
    elsewhere = root.parent / "elsewhere.bin"
    os.rename(root / "f.bin", elsewhere)
    os.symlink(elsewhere, root / "f.bin")
    with pytest.raises(StaleDataset):
        src.read_verified(tree, i, 0, SIZE)


def test_open_source_picks_the_kind(tmp_path: Path) -> None:
    assert isinstance(open_source(str(tmp_path)), LocalSource)
    assert isinstance(open_source(f"file://{tmp_path}"), FsspecSource)
    assert open_source(str(tmp_path)) is open_source(str(tmp_path))


def _stream(root: Path, tree: Tree, offsets: list[int]) -> bytearray:
    """The packed stream built by hand: every file's bytes at its offset."""
    end = max((offsets[i] + s for i, s in enumerate(tree.size) if s), default=0)
    out = bytearray(end)
    for i, mode in enumerate(tree.mode):
        if stat.S_ISREG(mode) and tree.size[i]:
            out[offsets[i] : offsets[i] + tree.size[i]] = (
                root / os.fsdecode(tree.path(i))
            ).read_bytes()
    return out


@pytest.mark.parametrize("with_fd", [False, True])
def test_fill_puts_every_byte_in_place(
    kind: str, with_fd: bool, tree: Path, tmp_path: Path
) -> None:
    seg_size = 4096
    src = _source(kind, tree)
    scanned = src.scan()  # its own listing: the versions each fill is checked against
    offsets, seg_len = plan_layout(scanned, seg_size)
    layout = Layout.of_tree(scanned, offsets, seg_len, seg_size)
    stream = _stream(tree, scanned, offsets)
    for seg, length in enumerate(seg_len):
        if with_fd:
            path = tmp_path / f"seg{seg}"
            with open(path, "w+b") as f:
                f.truncate(length)
                with mmap.mmap(f.fileno(), length) as m, memoryview(m) as view:
                    src.fill(scanned, layout, seg, view, fd=f.fileno())
            got = path.read_bytes()
        else:
            got = bytes(src.read_segment(scanned, layout, seg))
        base = seg * seg_size
        assert got == stream[base : base + length]


def _tree_of(sizes: list[int]) -> Tree:
    """A flat tree of regular files (and a folder and a link, which hold no stream bytes)."""
    tree = Tree()
    tree.append(b"", 0, stat.S_IFDIR | 0o755, 0, 0)
    tree.first_child[0] = 1
    for k, size in enumerate(sizes):
        tree.append(b"f%04d" % k, 0, stat.S_IFREG | 0o644, size, k)
    tree.append(b"zdir", 0, stat.S_IFDIR | 0o755, 0, 0)
    tree.append(b"zlink", 0, stat.S_IFLNK | 0o777, 5, 0)
    tree.child_count[0] = len(sizes) + 2
    return tree


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=30),
    seg_size=st.integers(1, 128),
    data=st.data(),
)
def test_layout_matches_a_byte_by_byte_reference(
    sizes: list[int], seg_size: int, data: st.DataObject
) -> None:
    tree = _tree_of(sizes)
    offsets, seg_len = plan_layout(tree, seg_size)
    layout = Layout.of_tree(tree, offsets, seg_len, seg_size)
    files = [i for i, s in enumerate(tree.size) if stat.S_ISREG(tree.mode[i]) and s]
    # Reference: where each byte of each file lies, and what lies at each byte of a segment.
    owner: dict[tuple[int, int], tuple[int, int]] = {}
    for i in files:
        for k in range(tree.size[i]):
            owner[divmod(offsets[i] + k, seg_size)] = (i, k)
    for i in range(1, len(sizes) + 1):
        size = tree.size[i]
        offset = data.draw(st.integers(0, size + 3))
        length = data.draw(st.none() | st.integers(0, size + 3))
        end = size if length is None else min(size, offset + length)
        want = [divmod(offsets[i] + k, seg_size) for k in range(offset, end)]
        got = [(s, o + j) for s, o, n in layout.ranges(i, offset, length) for j in range(n)]
        assert got == want
        assert all(n > 0 and o + n <= seg_size for _s, o, n in layout.ranges(i, offset, length))
    for seg, length in enumerate(seg_len):
        want_pieces = [owner[(seg, o)] + (o,) for o in range(seg_size) if (seg, o) in owner]
        got_pieces = [
            (p.entry, p.file_offset + j, p.seg_offset + j)
            for p in layout.segment_files(seg)
            for j in range(p.length)
        ]
        assert got_pieces == want_pieces
        assert max((o for _e, _k, o in want_pieces), default=-1) + 1 == length
    held = set(data.draw(st.lists(st.integers(0, max(len(seg_len) - 1, 0)), max_size=4)))
    held &= set(range(len(seg_len)))
    want_files = sorted({owner[key][0] for key in owner if key[0] in held})
    assert layout.files_in(held) == want_files
