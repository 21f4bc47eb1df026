"""Unit tests of the segment layout plan and the manifest file format."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.format.errors import DataError, NotFound
from kspeedfs.format.manifest import Manifest, plan_layout, write_manifest
from kspeedfs.format.tree import Tree
from kspeedfs.sources.scan import scan_tree

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def flat_tree(sizes: list[int]) -> Tree:
    """A root folder holding one file per size (plus a subfolder, which takes no bytes)."""
    t = Tree()
    t.names.append(b"")
    t.parent.append(0)
    t.mode.append(DIR)
    t.size.append(0)
    t.mtime_ns.append(0)
    t.first_child.append(1)
    t.child_count.append(len(sizes) + 1)
    for i, size in enumerate(sizes):
        t.names.append(b"f%06d" % i)
        t.parent.append(0)
        t.mode.append(FILE)
        t.size.append(size)
        t.mtime_ns.append(i)
        t.first_child.append(0)
        t.child_count.append(0)
    t.names.append(b"zz-dir")
    t.parent.append(0)
    t.mode.append(DIR)
    t.size.append(0)
    t.mtime_ns.append(0)
    t.first_child.append(len(sizes) + 2)
    t.child_count.append(0)
    return t


def check_layout(tree: Tree, seg: int) -> None:
    offsets, seg_len = plan_layout(tree, seg)
    spans = []
    for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True)):
        if not stat.S_ISREG(mode) or size == 0:
            continue
        start, end = offsets[i], offsets[i] + size
        spans.append((start, end))
        if size <= seg:
            assert start // seg == (end - 1) // seg, "a file that fits straddles two segments"
        elif start % seg:
            raise AssertionError("a file larger than a segment does not start one")
        # Every byte of the file lies inside the stored part of its segments.
        for k in range(start // seg, (end - 1) // seg + 1):
            assert min(end, (k + 1) * seg) - k * seg <= seg_len[k]
    spans.sort()
    for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False):
        assert a_end <= b_start, "files overlap"
    assert all(0 < n <= seg for n in seg_len)
    if spans:
        last_end = max(e for _, e in spans)
        assert len(seg_len) == (last_end + seg - 1) // seg
        assert seg_len[-1] == last_end - (len(seg_len) - 1) * seg
    else:
        assert seg_len == []


def test_layout_examples() -> None:
    seg = 100
    offsets, seg_len = plan_layout(flat_tree([60, 60, 40, 250, 0, 10]), seg)
    # 60 at 0; 60 does not fit the 40 left, so it opens segment 1; 40 fits after it;
    # 250 starts segment 2 and spans 3 segments; the empty file takes nothing; 10 follows.
    assert offsets[1:7] == [0, 100, 160, 200, 450, 450]
    assert seg_len == [60, 100, 100, 100, 60]


def test_empty_dataset_has_no_segments() -> None:
    assert plan_layout(flat_tree([]), 4096) == ([0, 0], [])
    assert plan_layout(flat_tree([0, 0]), 4096)[1] == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=5000), max_size=60),
    st.sampled_from([1, 7, 512, 1000, 4096]),
)
def test_layout_invariants(sizes: list[int], seg: int) -> None:
    check_layout(flat_tree(sizes), seg)


def test_layout_of_the_awkward_tree(tree: Path) -> None:
    check_layout(scan_tree(tree), 1 << 20)


def build(tree: Tree, dest: Path, seg: int = 1 << 20) -> Manifest:
    offsets, seg_len = plan_layout(tree, seg)
    checksums = [i * 1000 + 7 for i in range(len(tree))]
    write_manifest(
        dest,
        tree,
        offsets,
        checksums,
        seg_len,
        [k + 1 for k in range(len(seg_len))],
        {"uuid": "u-1", "segment_size": seg, "name": "t"},
    )
    return Manifest(dest)


def test_manifest_round_trip(tree: Path, tmp_path: Path) -> None:
    scanned = scan_tree(tree)
    m = build(scanned, tmp_path / "m.ksm")
    assert m.uuid == "u-1" and m.segment_size == 1 << 20
    assert m.entries == len(scanned)
    assert not (tmp_path / "m.ksm.tmp").exists()
    src = os.fsencode(tree)
    seen = set()
    for i in range(m.entries):
        rel = m.path(i)
        assert m.resolve(rel) == i
        assert m.name(i) == scanned.names[i]
        assert int(m.size[i]) == scanned.size[i]
        assert int(m.mode[i]) == scanned.mode[i]
        assert int(m.mtime_ns[i]) == scanned.mtime_ns[i]
        assert int(m.checksum[i]) == i * 1000 + 7
        if i:
            assert i in m.children(int(m.parent[i]))
            seen.add(rel)
        full = os.path.join(src, rel) if rel else src
        st_ = os.lstat(full)
        assert stat.S_IFMT(st_.st_mode) == stat.S_IFMT(int(m.mode[i]))
        if m.is_dir(i):
            assert sorted(m.name(k) for k in m.children(i)) == sorted(os.listdir(full))
        if stat.S_ISLNK(int(m.mode[i])):
            assert m.link_target(i) == os.readlink(full)
    assert b"raw-\xff\xfe/latin1-\xe9.bin" in seen
    assert "ünïcødé-数据.txt".encode() in seen
    files = list(m.iter_files())
    assert [m.path(i) for i in files] == [
        scanned.path(i) for i in range(len(scanned)) if stat.S_ISREG(scanned.mode[i])
    ]
    assert m.lookup(0, b"nope") is None
    assert m.children(m.resolve("a/small.txt")) == range(0)
    with pytest.raises(NotFound):
        m.resolve("a/nope.txt")


def test_ranges_cover_the_file(tree: Path, tmp_path: Path) -> None:
    seg = 4096
    m = build(scan_tree(tree), tmp_path / "m.ksm", seg)
    big = m.resolve("big.bin")
    size = int(m.size[big])
    pieces = m.ranges(big)
    assert sum(n for _, _, n in pieces) == size
    assert all(off >= 0 and off + n <= seg for _, off, n in pieces)
    assert [s for s, _, _ in pieces] == list(range(pieces[0][0], pieces[0][0] + len(pieces)))
    assert m.ranges(big, seg - 10, 30) == [
        (pieces[0][0], seg - 10, 10),
        (pieces[0][0] + 1, 0, 20),
    ]
    assert m.ranges(big, size - 5, 100) == [
        (pieces[-1][0], (size - 5) - (len(pieces) - 1) * seg, 5)
    ]
    assert m.ranges(big, size, 10) == []
    assert m.ranges(m.resolve("a/empty.bin")) == []


def test_missing_and_corrupt_manifests(tree: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        Manifest(tmp_path / "absent.ksm")
    good = tmp_path / "m.ksm"
    build(scan_tree(tree), good)
    data = good.read_bytes()
    cases = {
        "empty": b"",
        "magic": b"XXXXXXXX" + data[8:],
        "header length": data[:8] + b"\xff\xff\xff\x7f" + data[12:],
        "header json": data[:12] + b"{" * 40 + data[52:],
        "truncated": data[: len(data) // 2],
    }
    for what, blob in cases.items():
        bad = tmp_path / f"bad-{what.replace(' ', '-')}.ksm"
        bad.write_bytes(blob)
        with pytest.raises(DataError):
            Manifest(bad)


def test_header_without_counts_is_a_data_error(tmp_path: Path) -> None:
    import json
    import struct

    from kspeedfs.format.manifest import MAGIC

    blob = json.dumps({"format": 1, "arrays": {}}).encode()
    path = tmp_path / "bad.ksm"
    path.write_bytes(MAGIC + struct.pack("<I", len(blob)) + blob)
    with pytest.raises(DataError, match="corrupt manifest"):
        Manifest(path)


NS = 1_000_000_000
# Every time a Linux filesystem can hold: tmpfs holds any 64-bit second.
TIMES = st.integers(min_value=-(2**63) * NS, max_value=(2**63 - 1) * NS + NS - 1)


def dated_tree(times: list[tuple[int, int]]) -> Tree:
    """A root folder (dated 0) holding one byte files dated (mtime_ns, ctime_ns)."""
    tree = Tree()
    tree.append(b"", 0, DIR, 0, 0)
    tree.first_child[0], tree.child_count[0] = 1, len(times)
    for i, (mtime, ctime) in enumerate(times):
        tree.append(b"f%06d" % i, 0, FILE, 1, mtime, ctime_ns=ctime)
    return tree


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(TIMES, TIMES), min_size=1, max_size=20))
def test_times_of_the_full_range_round_trip(
    tmp_path_factory: pytest.TempPathFactory, times: list[tuple[int, int]]
) -> None:
    tree = dated_tree(times)
    m = build(tree, tmp_path_factory.mktemp("t") / "m.ksm")
    for i, (mtime, ctime) in enumerate(times, start=1):
        assert m.mtime_ns[i] == mtime
        assert m.ctime_ns[i] == ctime
        assert m.stat_fields(i)[4] == mtime
        assert divmod(mtime, NS) == (int(m.mtime_s[i]), int(m.mtime_nsec[i]))


def test_a_format_3_manifest_reads_with_its_times(tmp_path: Path) -> None:
    """Manifests written before format 4 (kept in the shm folder across an upgrade) kept times
    as signed 64-bit nanoseconds: they read as the same times."""
    import numpy as np

    from kspeedfs.format.manifest import write_arrays

    times = [0, -1, -(2**62), 2**62, 1_700_000_000_123_456_789, -NS]
    tree = dated_tree([(t, t // 3) for t in times])
    new = build(tree, tmp_path / "new.ksm")
    arrays = {}
    for key in new.header["arrays"]:
        offset, dtype, count = new.header["arrays"][key]
        arrays[key] = np.frombuffer(new._map, dtype=dtype, count=count, offset=offset).copy()
    for key in ("mtime", "ctime"):
        s, nsec = arrays.pop(f"{key}_s"), arrays.pop(f"{key}_nsec")
        arrays[f"{key}_ns"] = (s * NS + nsec).astype("<i8")
    header = {k: v for k, v in new.header.items() if k != "arrays"}
    write_arrays(tmp_path / "old.ksm", arrays, dict(header, format=3))
    old = Manifest(tmp_path / "old.ksm")
    assert old.header["format"] == 3
    for i in range(old.entries):
        assert old.mtime_ns[i] == new.mtime_ns[i] == tree.mtime_ns[i]
        assert old.ctime_ns[i] == tree.ctime_ns[i]
        assert old.stat_fields(i) == new.stat_fields(i)
    del arrays["ctime_ns"]  # format 2: no ctime yet, read as 0 ("not recorded")
    write_arrays(tmp_path / "older.ksm", arrays, dict(header, format=2))
    older = Manifest(tmp_path / "older.ksm")
    assert [older.mtime_ns[i] for i in range(older.entries)] == tree.mtime_ns
    assert [older.ctime_ns[i] for i in range(older.entries)] == [0] * older.entries
