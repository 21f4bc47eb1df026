"""kspeedfs:// against real nodes: pyarrow, datasets and plain fsspec read the cache's bytes, with
no FUSE; an open file keeps its instance; writes, bad names and missing paths are clear errors."""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest
from clusterutil import Cluster, running
from conftest import KSPEEDFS, NodeProcess, preload, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyarrow.fs import FSSpecHandler, PyFileSystem

from kspeedfs.format.errors import AuthError, InvalidArgument, ReadOnlyFileSystem, StaleDataset
from kspeedfs.stacks.filesystem import KSpeedFileSystem

# Pieces of hostile paths: separators, dots, NUL, lone surrogates (not encodable), real names.
PATH_PARTS = [
    "ds",
    "/",
    ".",
    "..",
    "sub",
    "small.txt",
    "link",
    "\x00",
    "\ud800",
    "\udcff",
    "é",
    "kspeedfs://",
]
BIG = 3 * (1 << 20) + 4321  # over three of the node's 1 MiB segments
ROWS = 60_000


def make_source(root: Path) -> pa.Table:
    """A parquet table over several segments, JSON lines, a big binary file, a nested file
    and a symlink; returns the table."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(ROWS),
            "x": rng.random(ROWS),
            "label": [f"row-{i % 977}" for i in range(ROWS)],
        }
    )
    pq.write_table(table, root / "t.parquet", row_group_size=8000)
    with open(root / "d.jsonl", "w") as f:
        for i in range(500):
            f.write(json.dumps({"i": i, "text": f"line {i} " * (i % 7)}) + "\n")
    (root / "big.bin").write_bytes(rng.bytes(BIG))
    (root / "sub").mkdir()
    (root / "sub" / "small.txt").write_bytes(b"hello kspeedfs\n")
    os.symlink("sub/small.txt", root / "link")
    return table


def kspeed(node_or_nodes: str, token: Path, **options: Any) -> KSpeedFileSystem:
    fs = fsspec.filesystem(
        "kspeedfs", nodes=node_or_nodes, token=str(token), skip_instance_cache=True, **options
    )
    assert isinstance(fs, KSpeedFileSystem)
    return fs


@pytest.fixture(autouse=True)
def fresh_instances() -> Iterator[None]:
    """fsspec caches filesystems by their storage options; one made from the environment of an
    earlier test (its nodes gone) must not serve the next."""
    KSpeedFileSystem.clear_instance_cache()
    yield
    KSpeedFileSystem.clear_instance_cache()


@pytest.fixture
def served(node: NodeProcess, tmp_path: Path) -> tuple[KSpeedFileSystem, Path, pa.Table]:
    src = tmp_path / "src"
    table = make_source(src)
    preload(node, src, "ds")
    return kspeed(node.address, node.token_file), src, table


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """datasets offline, with its cache in tmp_path (its config is read at import: set first)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_UPDATE_DOWNLOAD_COUNTS", "0")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    yield tmp_path / "hf"


def test_the_protocol_is_registered_by_the_entry_point() -> None:
    assert fsspec.get_filesystem_class("kspeedfs") is KSpeedFileSystem


def test_pyarrow_reads_the_source_table_every_way(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    fs, src, table = served
    assert pq.read_table("ds/t.parquet", filesystem=fs).equals(table)
    assert pq.read_table("kspeedfs://ds/t.parquet", filesystem=fs).equals(table)
    wrapped = PyFileSystem(FSSpecHandler(fs))
    assert pq.read_table("ds/t.parquet", filesystem=wrapped).equals(table)
    dataset = pds.dataset("ds", filesystem=fs, format="parquet", exclude_invalid_files=True)
    assert dataset.to_table().equals(table)
    rows = pq.ParquetFile("ds/t.parquet", filesystem=fs).read_row_group(3)
    assert rows.equals(pq.ParquetFile(src / "t.parquet").read_row_group(3))


def test_fsspec_open_with_settings_from_the_environment(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
    node: NodeProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fs, src, _table = served
    monkeypatch.setenv("KSPEEDFS_NODES", node.address)
    monkeypatch.setenv("KSPEEDFS_TOKEN_FILE", str(node.token_file))
    with fsspec.open("kspeedfs://ds/d.jsonl", "rt") as f:
        assert f.readlines() == (src / "d.jsonl").read_text().splitlines(keepends=True)
    with fsspec.open("kspeedfs://ds/link", "rb") as f:  # followed inside the dataset
        assert f.read() == b"hello kspeedfs\n"


def test_listing_matches_the_source_tree(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    fs, src, _table = served
    walked = sorted(
        os.path.relpath(os.path.join(d, f), src) for d, _dirs, files in os.walk(src) for f in files
    )
    assert fs.find("ds") == [f"ds/{p}" for p in walked]
    assert fs.ls("", detail=False) == ["ds"]
    assert sorted(fs.ls("ds", detail=False)) == sorted(f"ds/{p}" for p in os.listdir(src))
    assert fs.glob("kspeedfs://ds/*.parquet") == ["ds/t.parquet"]
    assert fs.glob("ds/**/*.txt") == ["ds/sub/small.txt"]
    info = fs.info("ds/big.bin")
    assert (info["type"], info["size"]) == ("file", BIG)
    assert info["mtime"] == pytest.approx(os.stat(src / "big.bin").st_mtime)
    assert fs.info("ds/sub")["type"] == "directory"
    assert fs.info("ds/link")["type"] == "link"
    assert fs.isdir("ds") and fs.isfile("ds/t.parquet") and not fs.exists("ds/nothing")


def test_datasets_loads_parquet_and_json_as_from_the_source(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
    node: NodeProcess,
    hf_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datasets

    _fs, src, _table = served
    monkeypatch.setenv("KSPEEDFS_NODES", node.address)
    monkeypatch.setenv("KSPEEDFS_TOKEN_FILE", str(node.token_file))
    for kind, name in (("parquet", "t.parquet"), ("json", "d.jsonl")):
        local = datasets.load_dataset(kind, data_files=str(src / name), split="train")
        pattern = f"kspeedfs://ds/*{os.path.splitext(name)[1]}"  # a glob, resolved by the fs
        streamed = datasets.load_dataset(kind, data_files=pattern, split="train", streaming=True)
        assert list(streamed) == local.to_list()
    # A non-streaming load "downloads" into the HF cache first, a step datasets' offline mode
    # refuses for any URL that is not a local path (its fsspec_head); nothing reaches the hub.
    # Here the settings are storage options, the environment names no node.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("KSPEEDFS_NODES")
    monkeypatch.delenv("KSPEEDFS_TOKEN_FILE")
    options = {"nodes": node.address, "token": str(node.token_file)}
    for kind, name in (("parquet", "t.parquet"), ("json", "d.jsonl")):
        local = datasets.load_dataset(kind, data_files=str(src / name), split="train")
        ours = datasets.load_dataset(
            kind, data_files=f"kspeedfs://ds/{name}", split="train", storage_options=options
        )
        assert ours.data.table.equals(local.data.table)


ranges = st.lists(
    st.tuples(
        st.one_of(st.none(), st.integers(-BIG - 10, BIG + 10)),
        st.one_of(st.none(), st.integers(-BIG - 10, BIG + 10)),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(wanted=ranges)
def test_cat_ranges_equal_the_source_bytes(
    served: tuple[KSpeedFileSystem, Path, pa.Table], wanted: list[tuple[int | None, int | None]]
) -> None:
    fs, src, _table = served
    data = (src / "big.bin").read_bytes()
    paths = ["ds/big.bin"] * len(wanted)
    got = fs.cat_ranges(paths, [s for s, _ in wanted], [e for _, e in wanted])
    assert got == [data[s:e] for s, e in wanted]
    s, e = wanted[0]
    assert fs.cat_file("ds/big.bin", s, e) == data[s:e]


def test_cat_ranges_read_once_per_node_over_the_network(
    served: tuple[KSpeedFileSystem, Path, pa.Table], node: NodeProcess
) -> None:
    _fs, src, _table = served
    remote = kspeed(node.address, node.token_file, local=False)
    data = (src / "big.bin").read_bytes()
    starts = list(range(0, BIG, BIG // 40))
    reader = remote._reader("ds")
    before = reader.cluster.stats["remote"]
    got = remote.cat_ranges(
        ["ds/big.bin"] * len(starts) + ["ds/nothing"],
        [*starts, 0],
        [s + 5000 for s in starts] + [1],
    )
    assert got[:-1] == [data[s : s + 5000] for s in starts]
    assert isinstance(got[-1], FileNotFoundError)
    assert reader.cluster.stats["remote"] - before == 1  # one vectored read for 41 ranges


seeks = st.lists(
    st.tuples(st.sampled_from([0, 1, 2]), st.integers(-BIG, BIG), st.integers(0, 3 << 20)),
    min_size=1,
    max_size=10,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=seeks, local=st.booleans())
def test_random_seek_and_read_equal_the_source_bytes(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
    node: NodeProcess,
    ops: list[tuple[int, int, int]],
    local: bool,
) -> None:
    fs, src, _table = served
    if not local:
        fs = kspeed(node.address, node.token_file, local=False)
    data = (src / "big.bin").read_bytes()
    with fs.open("ds/big.bin", "rb") as f, open(src / "big.bin", "rb") as ref:
        for k, (whence, offset, n) in enumerate(ops):
            try:
                expected_pos = ref.seek(offset, whence)
            except OSError:
                with pytest.raises(InvalidArgument):
                    f.seek(offset, whence)
                continue
            assert f.seek(offset, whence) == expected_pos == f.tell()
            if k % 3 == 0:
                buf = bytearray(n)
                got = bytes(buf[: f.readinto(buf)])
            elif k % 3 == 1:
                got = bytes(f.read_buffer(n))
            else:
                got = f.read(n)
            assert got == ref.read(n) == data[expected_pos : expected_pos + n]
            assert f.tell() == ref.tell()


def test_local_reads_are_views_of_the_mapped_segment(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    fs, src, _table = served
    with fs.open("ds/big.bin") as f:
        f.seek(1000)
        view = f.read_buffer(50_000)
        assert isinstance(view, memoryview) and isinstance(view.obj, mmap.mmap)
        assert bytes(view) == (src / "big.bin").read_bytes()[1000:51_000]


def test_an_open_file_keeps_its_instance_across_unload_and_reload(
    node: NodeProcess, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    old = os.urandom(BIG)
    (src / "big.bin").write_bytes(old)
    preload(node, src, "ds")
    fs = kspeed(node.address, node.token_file)
    f = fs.open("ds/big.bin")
    assert f.read(1000) == old[:1000]  # its first segment mapped
    done = run_cli("unload", "ds", env=node.env())
    assert done.returncode == 0, done.stderr
    new = os.urandom(BIG)
    (src / "big.bin").write_bytes(new)  # same size, new bytes and time
    preload(node, src, "ds")
    assert f.read(1000) == old[1000:2000]  # still mapped: the old instance's bytes
    f.seek(BIG - 1000)  # a segment never mapped: gone with the instance, and the source changed
    with pytest.raises(StaleDataset):
        f.read(1000)
    fs.invalidate_cache()
    assert fs.cat_file("ds/big.bin") == new  # a new open reaches the new instance
    f.close()


def read_whole(fs: KSpeedFileSystem, path: str) -> bytes:
    return fs.cat_file(path)


def test_a_pickled_or_forked_filesystem_reads_the_same(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    """What DataLoader and datasets workers get: the filesystem pickled (storage options
    only), or inherited by fork with its maps and without its connections."""
    fs, src, _table = served
    data = (src / "big.bin").read_bytes()
    assert fs.cat_file("ds/big.bin") == data  # mapped and connected before the fork
    clone = pickle.loads(pickle.dumps(fs))
    assert clone.cat_file("ds/big.bin") == data
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.starmap(read_whole, [(fs, "ds/big.bin"), (fs, "ds/sub/small.txt")])
    assert got == [data, b"hello kspeedfs\n"]


def test_writes_are_refused_and_change_nothing(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    fs, _src, _table = served
    before = fs.find("ds", withdirs=True, detail=True)
    attempts = [
        lambda: fs.open("ds/new.bin", "wb"),
        lambda: fs.open("ds/t.parquet", "ab"),
        lambda: fs.pipe_file("ds/t.parquet", b"x"),
        lambda: fs.rm("ds/t.parquet"),
        lambda: fs.rm_file("ds/t.parquet"),
        lambda: fs.mkdir("ds/dir"),
        lambda: fs.makedirs("ds/a/b", exist_ok=True),
        lambda: fs.rmdir("ds/sub"),
        lambda: fs.touch("ds/t.parquet"),
        lambda: fs.mv("ds/t.parquet", "ds/u.parquet"),
        lambda: fs.copy("ds/t.parquet", "ds/u.parquet"),
        lambda: fs.put_file(__file__, "ds/x.py"),
        lambda: pq.write_table(pa.table({"a": [1]}), "ds/w.parquet", filesystem=fs),
    ]
    for attempt in attempts:
        with pytest.raises(ReadOnlyFileSystem, match="read-only") as raised:
            attempt()
        assert isinstance(raised.value, PermissionError)
    assert fs.find("ds", withdirs=True, detail=True) == before


def test_bad_names_and_missing_paths_are_clear_errors(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    fs, _src, _table = served
    for missing in ("ds/nothing", "ds/sub/nothing/deeper", "other/t.parquet", "ds/sub/small.txt/x"):
        with pytest.raises(FileNotFoundError, match="no such file|no dataset named"):
            fs.info(missing)
        with pytest.raises(FileNotFoundError):
            fs.open(missing)
    with pytest.raises(FileNotFoundError):
        pq.read_table("ds/nothing.parquet", filesystem=fs)
    with pytest.raises(IsADirectoryError):
        fs.open("ds/sub")
    for bad in ("Bad Name/x", "ds/../ds/t.parquet", "a" * 80):
        with pytest.raises(InvalidArgument):
            fs.info(bad)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.one_of(st.text(), st.lists(st.sampled_from(PATH_PARTS), max_size=8).map("".join)))
def test_any_path_is_found_or_a_clear_error(
    served: tuple[KSpeedFileSystem, Path, pa.Table], path: str
) -> None:
    fs, _src, _table = served
    is_found_or_a_clear_error(fs, path)


def test_unencodable_paths_are_not_found(
    served: tuple[KSpeedFileSystem, Path, pa.Table],
) -> None:
    fs, _src, _table = served
    fs.info("ds/sub/small.txt")  # its folder known: the next lookups in it take the short way
    for path in ("ds/\ud800", "ds/sub/\ud800x", "ds/\udcff/\ud800"):
        with pytest.raises(FileNotFoundError):
            fs.info(path)
        is_found_or_a_clear_error(fs, path)


def is_found_or_a_clear_error(fs: KSpeedFileSystem, path: str) -> None:
    try:
        info = fs.info(path)
    except (FileNotFoundError, InvalidArgument):
        with pytest.raises((FileNotFoundError, InvalidArgument, IsADirectoryError)):
            fs.cat_file(path)
    else:
        assert info["name"] == fs._strip_protocol(path)


def test_a_user_and_password_replace_the_token(
    served: tuple[KSpeedFileSystem, Path, pa.Table], node: NodeProcess
) -> None:
    _fs, src, _table = served
    argv = [*KSPEEDFS, "user", "add", "reader", "--role", "read", "--password-stdin"]
    done = subprocess.run(
        argv, env=node.env(), input="s3cret\n", capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    fs = fsspec.filesystem(
        "kspeedfs", nodes=node.address, user="reader", password="s3cret", skip_instance_cache=True
    )
    assert fs.cat_file("ds/sub/small.txt") == (src / "sub" / "small.txt").read_bytes()
    wrong = fsspec.filesystem(
        "kspeedfs", nodes=node.address, user="reader", password="nope", skip_instance_cache=True
    )
    with pytest.raises(AuthError):
        wrong.ls("ds")
    with pytest.raises(InvalidArgument, match="needs a password"):
        fsspec.filesystem("kspeedfs", nodes=node.address, user="reader", skip_instance_cache=True)


def test_a_cluster_serves_the_table_with_nodes_killed(token_file: Path, tmp_path: Path) -> None:
    """Three nodes, replicas 2, a reader on none of them: every read is remote; one node
    killed, the replicas serve; two killed, the source serves what has no copy left; all
    three, the source serves it all."""
    src = tmp_path / "src"
    table = make_source(src)
    with running(Cluster(token_file, tmp_path, segment_size="256KiB")) as cluster:
        cluster.preload(src, "ds", replicas=2)
        fs = kspeed(",".join(cluster.addresses), token_file)
        assert pq.read_table("ds/t.parquet", filesystem=fs).equals(table)
        data = (src / "big.bin").read_bytes()
        starts = list(range(0, BIG - 3000, BIG // 200))
        stats = fs._reader("ds").cluster.stats
        before = stats["remote"]
        got = fs.cat_ranges(["ds/big.bin"] * len(starts), starts, [s + 3000 for s in starts])
        assert got == [data[s : s + 3000] for s in starts]
        assert stats["remote"] - before <= 3  # 200 ranges over 13 segments: a read per node
        # Kill first the two holders of the table's first segment: it has no copy left then.
        reader = fs._reader("ds")
        m = reader.manifest
        seg = m.ranges(m.resolve("t.parquet"))[0][0]
        holders = reader.handle.owners(seg)
        first, second, third = sorted(cluster.nodes, key=lambda n: n.address not in holders)
        first.kill9()
        assert pq.read_table("ds/t.parquet", filesystem=fs).equals(table)
        assert fs.cat_file("ds/big.bin") == data
        second.kill9()
        fresh = kspeed(",".join(cluster.addresses), token_file)
        assert pq.read_table("ds/t.parquet", filesystem=fresh).equals(table)
        assert fresh._reader("ds").cluster.stats["source"] > 0
        third.kill9()  # no node left: what is known is served from the source
        fresh.invalidate_cache()
        assert pq.read_table("ds/t.parquet", filesystem=fresh).equals(table)
        assert fresh.cat_file("ds/big.bin") == data
