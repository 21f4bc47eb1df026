"""The meta index format on its own: parsing, resolution against a manifest, bad lines, mapping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kspeedfs.format import metaindex
from kspeedfs.format.errors import DataError, InvalidArgument
from kspeedfs.format.manifest import Manifest, plan_layout, write_manifest
from kspeedfs.sources.scan import scan_tree


def manifest_of(root: Path, out: Path) -> Manifest:
    tree = scan_tree(root)
    offsets, seg_len = plan_layout(tree, 1 << 20)
    write_manifest(
        out,
        tree,
        offsets,
        [0] * len(tree),
        seg_len,
        [0] * len(seg_len),
        {"name": "t", "uuid": "u1", "source": str(root), "segment_size": 1 << 20},
    )
    return Manifest(out)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for d in ("train/a", "train/b", "val"):
        (root / d).mkdir(parents=True)
    for rel in ("train/a/1.jpg", "train/a/2.jpg", "train/b/3.jpg", "val/4.jpg", "top.jpg"):
        (root / rel).write_bytes(rel.encode())
    return root


def build(tmp_path: Path, data: Path, text: str) -> metaindex.MetaIndex:
    m = manifest_of(data, tmp_path / "m.ksm")
    out = tmp_path / "x.kmi"
    metaindex.build_index(text.encode(), m, out, {"uuid": "u1", "meta": "train.txt"})
    return metaindex.MetaIndex(out)


def test_text_lines_resolve_to_entries_targets_and_raw_ranges(tmp_path: Path, data: Path) -> None:
    m = manifest_of(data, tmp_path / "m.ksm")
    text = "train/a/1.jpg 0\ntrain/b/3.jpg 1\r\n./top.jpg 7\n\nval/4.jpg 2"
    out = tmp_path / "x.kmi"
    metaindex.build_index(text.encode(), m, out, {"uuid": "u1", "meta": "train.txt"})
    idx = metaindex.MetaIndex(out)
    assert idx.uuid == "u1" and idx.rows == 5 and idx.target_kind == "int"
    assert [idx.line(r) for r in range(5)] == text.encode().split(b"\n")
    assert [m.path(int(e)) for e in idx.entry[[0, 1, 2, 4]]] == [
        b"train/a/1.jpg",
        b"train/b/3.jpg",
        b"top.jpg",
        b"val/4.jpg",
    ]
    assert int(idx.entry[3]) == metaindex.BLANK
    assert idx.target.tolist() == [0, 1, 7, -1, 2]
    assert idx.good is not None and idx.good.tolist() == [0, 1, 2, 4]
    assert idx.header["bad"] == 0 and idx.header["missing"] == 0 and idx.header["blank"] == 1


def test_string_targets_go_to_a_sorted_table(tmp_path: Path, data: Path) -> None:
    idx = build(tmp_path, data, "train/a/1.jpg dog\ntrain/a/2.jpg cat\nval/4.jpg dog\n")
    assert idx.target_kind == "str"
    assert idx.strings() == ["cat", "dog"]
    assert [idx.target_of(r) for r in range(3)] == ["dog", "cat", "dog"]
    assert idx.good is None and idx.nonblank is None  # every line a sample: no row arrays


def test_json_lines_with_more_fields(tmp_path: Path, data: Path) -> None:
    lines = [
        {"filename": "train/a/1.jpg", "label": 3, "caption": "x"},
        {"path": "val/4.jpg", "target": 5},
    ]
    idx = build(tmp_path, data, "\n".join(json.dumps(x) for x in lines) + "\n")
    assert idx.header["kind"] == "jsonl"
    assert idx.target.tolist() == [3, 5]
    assert json.loads(idx.line(0))["caption"] == "x"


def test_bad_lines_and_missing_files_are_reported_with_line_numbers(
    tmp_path: Path, data: Path
) -> None:
    text = "train/a/1.jpg 0\nnot-a-pair\ntrain/zzz.jpg 1\ntrain/a 2\n../escape.jpg 3\n"
    idx = build(tmp_path, data, text)
    assert int(idx.entry[0]) >= 0 and int(idx.entry[1]) == metaindex.BAD_LINE
    assert idx.header["bad"] == 1 and idx.header["missing"] == 3
    assert list(idx.problems()) == [
        (2, "expected PATH TARGET"),
        (3, "no file train/zzz.jpg"),
        (4, "not a file train/a"),
        (5, "no file ../escape.jpg"),
    ]
    assert "line 3: no file train/zzz.jpg" in idx.describe_problems()
    assert idx.good is not None and idx.good.tolist() == [0]


def test_meta_names_are_normalized_and_kept_inside() -> None:
    assert metaindex.meta_name("./lists//train.txt") == "lists/train.txt"
    for bad in ("", "/", "../x.txt", "/abs/../../x"):
        with pytest.raises(InvalidArgument):
            metaindex.meta_name(bad)
    assert metaindex.index_file("a.txt") != metaindex.index_file("b.txt")


def test_a_corrupt_index_is_refused(tmp_path: Path, data: Path) -> None:
    idx = build(tmp_path, data, "top.jpg 1\n")
    blob = bytearray(idx.file.read_bytes())
    blob[-3] ^= 0xFF
    bad = tmp_path / "bad.kmi"
    bad.write_bytes(bytes(blob))
    with pytest.raises(DataError):
        metaindex.MetaIndex(bad)


def test_line_bounds_match_split_lines() -> None:
    for raw in (b"", b"a", b"a\n", b"a\n\nb", b"\n\n", b"x y\nz w\n"):
        starts, lengths = metaindex.line_bounds(raw)
        got = [raw[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        want = raw.split(b"\n")
        if raw.endswith(b"\n") or not raw:
            want = want[:-1]
        assert got == want, raw
    assert np.asarray(metaindex.line_bounds(b"ab\ncd")[1]).tolist() == [2, 2]
