"""The merged tar view's table (kspeedfs.format.tarmerge), in process: random trees split over
random shards equal GNU tar's extraction of every shard in path order; a damaged shard and a
shard that makes a file of another's folder are refused whole, the rest shown."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from untarutil import extract_in_order, merged_tree_of, shard_tars, shards_st, tree_of

from kspeedfs.format import tarmerge, tarscan


def merged(tars: dict[str, bytes]) -> tuple[tarmerge.MergedTree, list[str]]:
    order = sorted(tars, key=lambda p: p.encode())

    def shard(rel: str) -> tarmerge.Shard:
        raw = tars[rel]
        return rel.rpartition("/")[0].encode(), lambda o, n: raw[o : o + n], len(raw)

    return tarmerge.merge(shard(rel) for rel in order), order


def shown(tree: tarmerge.MergedTree, tars: dict[str, bytes], order: list[str]) -> Any:
    def member(shard: int, offset: int, size: int) -> bytes:
        return tars[order[shard]][offset : offset + size]

    return merged_tree_of(tree, member)


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=shards_st)
def test_merged_table_equals_extraction_in_order(
    drawn: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tars = shard_tars(*drawn)
    tree, order = merged(tars)
    assert tree.refused == {}
    want = tree_of(extract_in_order(tars, tmp_path_factory.mktemp("x")))
    assert shown(tree, tars, order) == want
    for path, (kind, _data) in want.items():  # every path found by lookup, as itself
        row = tree.resolve(path)
        assert row is not None and tree.path(row) == path
        assert tree.is_dir(row) == (kind == "dir")


def test_a_damaged_shard_is_refused_and_the_others_shown(tmp_path: Path) -> None:
    good = {f"s{k}.tar": tar_of([(f"c{k % 2}/{k}.jpg", bytes([k]) * 700)]) for k in range(4)}
    bad = bytearray(tar_of([("c0/b1.jpg", b"1" * 600), ("c0/b2.jpg", b"2" * 600)]))
    bad[512 * 3 + 148] ^= 0x5A  # the second header's checksum
    tars = {**good, "s1b.tar": bytes(bad)}
    tree, order = merged(tars)
    assert list(tree.refused) == [order.index("s1b.tar")]
    assert "unreadable tar header" in tree.refused[order.index("s1b.tar")]
    want = tree_of(extract_in_order(good, tmp_path / "x"))
    assert shown(tree, tars, order) == want


def test_a_shard_that_clashes_with_an_earlier_one_is_refused_whole() -> None:
    tars = {
        "a.tar": tar_of([("c/x.jpg", b"x"), ("keep.jpg", b"k")]),
        "b.tar": tar_of([("c", b"a file where a.tar has a folder"), ("b.jpg", b"b")]),
        "c.tar": tar_of([("keep.jpg/under", b"under a file"), ("c.jpg", b"c")]),
        "d.tar": tar_of([("c/y.jpg", b"y"), ("keep.jpg", b"K")]),
    }
    tree, order = merged(tars)
    assert sorted(order[s] for s in tree.refused) == ["b.tar", "c.tar"]
    assert shown(tree, tars, order) == {
        b"c": ("dir", b""),
        b"c/x.jpg": ("file", b"x"),
        b"c/y.jpg": ("file", b"y"),
        b"keep.jpg": ("file", b"K"),
    }


def test_a_refused_earlier_shard_does_not_refuse_a_later_one() -> None:
    """b.tar clashes with a.tar and is refused; c.tar clashes only with b.tar: it stays."""
    tars = {
        "a.tar": tar_of([("p/x", b"x")]),
        "b.tar": tar_of([("p", b"file"), ("q", b"file")]),
        "c.tar": tar_of([("q/y", b"y")]),
    }
    tree, order = merged(tars)
    assert [order[s] for s in tree.refused] == ["b.tar"]
    assert tree.resolve(b"q/y") is not None


def test_siblings_sort_by_name_bytes_and_lookups_find_them() -> None:
    names = ["b", "b!", "b.jpg", "a", "é", "B"]
    tars = {"s.tar": tar_of([("b/in.jpg", b"1")] + [(n, n.encode()) for n in names[1:]])}
    tree, _ = merged(tars)
    listed = [name for name, _ in tree.children(0)]
    assert listed == sorted(n.encode() for n in names)
    for n in names:
        assert tree.lookup(0, n.encode()) is not None
    assert tree.lookup(0, b"c") is None and tree.lookup(0, b"") is None
    assert tree.resolve(b"b/in.jpg") is not None and tree.resolve(b"b!/in.jpg") is None


def test_the_table_holds_arrays_and_counts_its_bytes() -> None:
    tars = {f"s{k}.tar": tar_of([(f"c{j}/{k}-{j}.jpg", b"x") for j in range(10)]) for k in range(5)}
    tree, _ = merged(tars)
    assert tree.members == 50 and tree.rows == 61  # the top, 10 folders, 50 files
    assert all(hasattr(a, "dtype") and a.dtype != object for a in tree.arrays.values())
    assert tree.nbytes >= sum(a.nbytes for a in tree.arrays.values())


def test_tars_without_members_show_their_folders_only() -> None:
    tree, _ = merged({"a/empty.tar": tar_of([]), "b.tar": tar_of([])})
    assert tree.refused == {} and tree.members == 0
    assert [name for name, _ in tree.children(0)] == [b"a"]
    tree, _ = merged({"empty.tar": tar_of([])})
    assert tree.rows == 1 and list(tree.children(0)) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=shards_st, damage=st.tuples(st.integers(0, 5), st.integers(0, 1 << 16)))
def test_the_bulk_header_scan_gives_what_the_tar_view_parser_gives(
    drawn: Any, damage: tuple[int, int]
) -> None:
    """Plain shards are read by tarscan, the others by tarview.parse: the same rows either
    way, damaged shards refused either way (one byte of one shard flipped)."""
    tars = shard_tars(*drawn)
    which, at = damage
    rel = sorted(tars)[which % len(tars)]
    raw = bytearray(tars[rel])
    if raw:
        raw[at % len(raw)] ^= 0x41
    tars[rel] = bytes(raw)
    scanned, order = merged(tars)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(tarscan, "scan", lambda read, size: None)
        parsed, _ = merged(tars)
    assert scanned.refused.keys() == parsed.refused.keys()
    assert shown(scanned, tars, order) == shown(parsed, tars, order)
    assert [int(scanned.mode[r]) for r in range(scanned.rows)] == [
        int(parsed.mode[r]) for r in range(parsed.rows)
    ]


def test_plain_shards_are_scanned_and_others_parsed() -> None:
    plain = tar_of([("c/x.jpg", b"x"), ("c/", b"")])
    assert tarscan.scan(lambda o, n: plain[o : o + n], len(plain)) is not None
    for odd in (tar_of([("c/" + "l" * 120 + ".jpg", b"x")]), tar_of([("../x", b"x")]), b""):
        assert tarscan.scan(lambda o, n, odd=odd: odd[o : o + n], len(odd)) is None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=shards_st)
def test_small_key_chunks_and_the_bytes_sort_give_the_same_table(drawn: Any) -> None:
    """Keys read 2 at a time (chunk edges everywhere) and sorted as Python bytes (the long
    names' way) give the table the one-array sort gives."""
    tars = shard_tars(*drawn)
    want, order = merged(tars)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(tarmerge, "_CHUNK_BITS", 1)
        patched.setattr(tarmerge, "SORT_BYTES", 0)
        got, _ = merged(tars)
    assert got.refused == want.refused
    for name in want.arrays:
        assert got.arrays[name].tolist() == want.arrays[name].tolist(), name
