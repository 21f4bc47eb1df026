"""Unit tests of the loader: staged segments hold the source's bytes, checksums match."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import xxhash

from kspeedfs.format.errors import DataError
from kspeedfs.format.layout import Layout
from kspeedfs.format.localdata import segment_path
from kspeedfs.format.manifest import plan_layout
from kspeedfs.sources.loader import Progress, load_segments, segment_checksums
from kspeedfs.sources.scan import scan_tree
from kspeedfs.sources.source import LocalSource

SEG = 4096


def stage(src: Path, held: set[int], staging: Path) -> tuple[dict[int, int], list[int], list[int]]:
    tree = scan_tree(src)
    offsets, seg_len = plan_layout(tree, SEG)
    (staging / "seg").mkdir(parents=True)
    layout = Layout.of_tree(tree, offsets, seg_len, SEG)
    sums = load_segments(LocalSource(str(src)), tree, layout, held, staging, Progress())
    return sums, offsets, seg_len


def test_every_held_byte_and_checksum(tree: Path, tmp_path: Path) -> None:
    scanned = scan_tree(tree)
    _, seg_len = plan_layout(scanned, SEG)
    everything = set(range(len(seg_len)))
    sums, offsets, seg_len = stage(tree, everything, tmp_path / "st")
    segs = [segment_path(tmp_path / "st", k).read_bytes() for k in range(len(seg_len))]
    assert [len(s) for s in segs] == seg_len
    stream = b"".join(s.ljust(SEG, b"\0") for s in segs)
    base = os.fsencode(tree)
    files = 0
    for i, mode in enumerate(scanned.mode):
        if not stat.S_ISREG(mode):
            continue
        data = Path(os.fsdecode(os.path.join(base, scanned.path(i)))).read_bytes()
        if data:
            files += 1
            assert stream[offsets[i] : offsets[i] + len(data)] == data
            assert sums[i] == xxhash.xxh3_64_intdigest(data)
    assert files == len(sums) > 30
    assert segment_checksums(tmp_path / "st", everything) == {
        k: xxhash.xxh3_64_intdigest(s) for k, s in enumerate(segs)
    }


def test_only_held_segments_are_staged(tree: Path, tmp_path: Path) -> None:
    scanned = scan_tree(tree)
    offsets, seg_len = plan_layout(scanned, SEG)
    held = set(range(0, len(seg_len), 2))
    sums, _, _ = stage(tree, held, tmp_path / "st")
    assert {int(p.name) for p in (tmp_path / "st" / "seg").iterdir()} == held
    big = next(i for i, n in enumerate(scanned.names) if n == b"big.bin")
    assert big not in sums  # it spans segments held elsewhere
    for i in sums:
        first, last = offsets[i] // SEG, (offsets[i] + scanned.size[i] - 1) // SEG
        assert set(range(first, last + 1)) <= held


@pytest.mark.parametrize("change", ["shorter", "longer"])
def test_a_source_that_changes_after_the_scan(tmp_path: Path, change: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(os.urandom(10000))
    tree = scan_tree(src)
    offsets, seg_len = plan_layout(tree, SEG)
    (src / "f.bin").write_bytes(os.urandom(9000 if change == "shorter" else 11000))
    (tmp_path / "st" / "seg").mkdir(parents=True)
    with pytest.raises(DataError, match=change):
        load_segments(
            LocalSource(str(src)),
            tree,
            Layout.of_tree(tree, offsets, seg_len, SEG),
            set(range(len(seg_len))),
            tmp_path / "st",
            Progress(),
        )
