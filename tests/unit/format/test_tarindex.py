"""Tar-shard indexes: the samples webdataset itself yields from the same bytes, or one line of
refusal (DataError) and no file, for any tar, damaged or hostile."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext

from kspeedfs.format.errors import DataError
from kspeedfs.format.tarindex import TarIndex, build_index, key_and_ext
from kspeedfs.sample import make_shards


def webdataset_samples(path: Path) -> list[dict[str, Any]]:
    """What webdataset yields from a shard, without its url fields."""
    return [
        {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
        for s in wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
    ]


def indexed_samples(raw: bytes, out: Path) -> list[dict[str, Any]]:
    build_index(raw, out, {"uuid": "u", "meta": "s.tar"})
    idx = TarIndex(out)
    assert (idx.uuid, idx.meta) == ("u", "s.tar")
    return [
        {"__key__": idx.key(j), **{ext: raw[o : o + n] for ext, o, n in idx.parts(j)}}
        for j in range(idx.samples)
    ]


def tar_of(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_generated_shards_index_as_webdataset_reads_them(tmp_path: Path) -> None:
    shards = make_shards(tmp_path / "shards", shards=2, per_shard=7, file_size=1500)
    for shard in shards:
        mine = indexed_samples(shard.read_bytes(), tmp_path / "i.kti")
        assert mine == webdataset_samples(shard)
        # The cases the shards are made to hold: keys with dots, an extension with a dot, a
        # key that comes back (more samples than keys).
        assert all("." in s["__key__"].split("/")[0] for s in mine)
        assert any("seg.bin" in s for s in mine)
        assert len({s["__key__"] for s in mine}) < len(mine)


names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=40,
)


@given(name=names)
def test_the_key_rule_is_webdatasets(name: str) -> None:
    prefix, suffix = base_plus_ext(name)
    got = key_and_ext(name)
    if prefix is None:
        assert got is None
    elif got is not None:  # webdataset skips __meta__ members before it splits names
        assert got == (prefix, suffix.lower())


members = st.lists(
    st.tuples(
        st.sampled_from(["a", "b.c", "d/e", "x.y/z", "__k__", "A", "__m__/f", "é\n"]),
        st.sampled_from(["jpg", "JPG", "cls", "seg.bin", "", "json"]),
        st.binary(max_size=1200),
    ),
    max_size=8,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    parts=members,
    odd=names,
    cut=st.integers(min_value=0, max_value=1 << 16),
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=3),
    fmt=st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]),
)
def test_any_tar_indexes_as_webdataset_reads_it_or_is_refused_in_one_line(
    tmp_path: Path,
    parts: list[tuple[str, str, bytes]],
    odd: str,
    cut: int,
    flips: list[tuple[int, int]],
    fmt: int,
) -> None:
    listed = [(f"{key}.{ext}" if ext else key, data) for key, ext, data in parts]
    raw = bytearray(tar_of([*listed, (odd, b"odd")], fmt))
    if cut < len(raw):
        del raw[cut:]  # truncated
    for pos, xor in flips:  # damaged headers (bad checksums), sizes, names
        if pos < len(raw):
            raw[pos] ^= xor
    shard, out = tmp_path / "s.tar", tmp_path / "i.kti"
    shard.write_bytes(raw)
    out.unlink(missing_ok=True)
    try:
        mine = indexed_samples(bytes(raw), out)
    except DataError as e:
        assert "\n" not in str(e).strip() or "\n" in odd  # one line (but for a name with one)
        assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
        return
    # Indexed: webdataset reads the very same samples from these bytes.
    assert mine == webdataset_samples(shard)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "checksum", "huge size", "not a tar", "empty"],
)
def test_damaged_tars_are_refused(tmp_path: Path, damage: str) -> None:
    raw = bytearray(tar_of([("k.jpg", b"x" * 3000), ("k.cls", b"1"), ("m.jpg", b"y" * 700)]))
    if damage == "truncated":
        del raw[1800:]
    elif damage == "checksum":
        raw[512 + 3072 + 100] ^= 0x40  # the second header (after the first and its data)
    elif damage == "huge size":  # a size far past the end, with a right checksum
        raw = bytearray(tar_of([("k.jpg", b"x")], tarfile.USTAR_FORMAT))
        raw[124:136] = b"77777777777\0"
        raw[148:156] = b" " * 8
        raw[148:156] = b"%06o\0 " % sum(raw[:512])
    elif damage == "not a tar":
        raw = bytearray(b"PK\x03\x04" + bytes(2000))
    else:
        raw = bytearray()
    out = tmp_path / "i.kti"
    with pytest.raises(DataError) as e:
        build_index(bytes(raw), out, {"uuid": "u", "meta": "s.tar"})
    assert "\n" not in str(e.value)
    assert not out.exists()


def test_a_duplicate_extension_in_a_sample_is_refused_as_webdataset_refuses_it(
    tmp_path: Path,
) -> None:
    raw = tar_of([("k.jpg", b"1"), ("k.JPG", b"2")])
    (tmp_path / "s.tar").write_bytes(raw)
    with pytest.raises(ValueError, match="duplicate"):
        webdataset_samples(tmp_path / "s.tar")
    with pytest.raises(DataError, match="two members"):
        build_index(raw, tmp_path / "i.kti", {"uuid": "u", "meta": "s.tar"})
