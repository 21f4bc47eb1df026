"""The tar view (`NAME@tar/`): every member of every tar a file at its path, equal to extraction.

In process: hypothesis tars (long names, nested folders, GNU and PAX formats, hard and symbolic
links, members replaced by later ones) parsed from their bytes equal `tarfile` extraction;
damaged headers and truncated tars are refused whole. Through a node (slow): the same tars,
larger than the node's 1 MiB segments so members straddle them, read through the mount and
through `kspeedfs://` and the fast path (`KSpeedTarFolder`), equal to extraction; a damaged tar
lists nothing; stock ImageFolder over the view equals ImageFolder over the extracted tree;
WebDataset opens `kspeedfs://` URLs.
"""

from __future__ import annotations

import errno
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from untarutil import tree_of

from kspeedfs.format import tarview
from kspeedfs.format.errors import DataError
from kspeedfs.stacks.filesystem import KSpeedFileSystem

FOLDERS = st.sampled_from(["a", "b", "a/c", "a/c/" + "d" * 120, "e" * 99, "ünï"])
FILES = st.one_of(
    st.sampled_from(["x.jpg", "y.png", "z", "é.txt"]),
    st.integers(0, 300).map(lambda n: "f" * (1 + n % 200) + f"{n}.bin"),
)
member_st = st.tuples(
    st.one_of(st.none(), FOLDERS),
    FILES,
    st.sampled_from(["file", "file", "file", "symlink", "hardlink", "dir"]),
    st.integers(0, 5000),
)


def build_tar(members: list[tuple[str | None, str, str, int]], fmt: int, seed: int = 0) -> bytes:
    """A tar of these members; a hard link points at the last file written before it (or is
    left out where there is none); folders and files never share a path, nor do symlinks and
    files, and a file hard-linked is not written again (extraction would write the later file
    through the link)."""
    out = io.BytesIO()
    files: list[str] = []
    linked: set[str] = set()
    used: set[str] = set()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for k, (folder, name, kind, size) in enumerate(members):
            path = f"{folder}/{name}" if folder else name
            if kind == "dir":
                info = tarfile.TarInfo((folder or "a") + "/")
                info.type = tarfile.DIRTYPE
                info.mode = 0o750
                tar.addfile(info)
                continue
            if kind == "symlink":  # never the path of a file: extraction would write through
                path += f"-sym{k}"
            info = tarfile.TarInfo(path)
            info.mtime = 1_600_000_000 + k
            if kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = f"../{name}-{k}"
                tar.addfile(info)
            elif kind == "hardlink":
                if not files or path in used:  # a fresh path: no link over a link
                    continue
                info.type = tarfile.LNKTYPE
                info.linkname = files[-1]
                linked.update((path, files[-1]))
                tar.addfile(info)
            else:
                if path in linked:  # tarfile would write through the link (GNU tar would not)
                    continue
                data = bytes((seed + k + i) % 251 for i in range(size))
                info.size = size
                info.mode = 0o755 if k % 5 == 0 else 0o644
                tar.addfile(info, io.BytesIO(data))
                files.append(path)
            used.add(path)
    return out.getvalue()


def extracted(raw: bytes, dest: Path) -> dict[bytes, tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(dest, filter="fully_trusted")
    return tree_of(dest)


def parsed(raw: bytes) -> dict[bytes, tuple[str, bytes]]:
    tree = tarview.parse(lambda off, n: raw[off : off + n], len(raw))
    out: dict[bytes, tuple[str, bytes]] = {}

    def walk(number: int, prefix: bytes) -> None:
        for name, child in tree.children(number):
            node = tree.nodes[child]
            if node.kind == tarview.DIR:
                out[prefix + name] = ("dir", b"")
                walk(child, prefix + name + b"/")
            elif node.kind == tarview.LINK:
                out[prefix + name] = ("link", node.target)
            else:
                out[prefix + name] = ("file", raw[node.offset : node.offset + node.size])

    walk(0, b"")
    return out


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(member_st, max_size=25),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
)
def test_parsed_tars_equal_extraction(
    members: list[Any], fmt: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    raw = build_tar(members, fmt)
    assert parsed(raw) == extracted(raw, tmp_path_factory.mktemp("x"))


@settings(max_examples=60, deadline=None)
@given(
    members=st.lists(member_st.filter(lambda m: m[2] == "file"), min_size=2, max_size=10),
    which=st.integers(1, 9),
    at=st.integers(0, 511),
    cut=st.booleans(),
)
def test_damaged_or_truncated_tars_are_refused_whole(
    members: list[Any], which: int, at: int, cut: bool
) -> None:
    raw = bytearray(build_tar(members, tarfile.GNU_FORMAT))
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as tar:
        infos = tar.getmembers()
    victim = infos[which % len(infos)]
    if cut:
        if victim.size == 0:
            return
        raw = raw[: victim.offset_data + victim.size // 2]  # a member runs past the end
    else:
        if at == 155 or at >= 500:
            at = 148  # after the checksum's NUL, the padding: bytes no reader looks at
        raw[victim.offset + at] ^= 0x5A
    with pytest.raises(DataError):
        tarview.parse(lambda off, n: bytes(raw[off : off + n]), len(raw))


def test_hostile_names_and_links_are_refused() -> None:
    for name, kind, target in (
        ("../escape.jpg", tarfile.REGTYPE, ""),
        ("a/../../escape.jpg", tarfile.REGTYPE, ""),
        ("dangling", tarfile.LNKTYPE, "no-such-file"),
    ):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info, io.BytesIO(b""))
        raw = out.getvalue()
        with pytest.raises(DataError):
            tarview.parse(lambda off, n, raw=raw: raw[off : off + n], len(raw))
    # A leading / is dropped, as extraction does.
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("/abs/x.jpg")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    raw = out.getvalue()
    assert parsed(raw) == {b"abs": ("dir", b""), b"abs/x.jpg": ("file", b"abc")}


# ---- through a node: the mount, kspeedfs:// and WebDataset (slow)


@pytest.fixture(autouse=True)
def fresh_instances() -> Iterator[None]:
    """fsspec keeps filesystems by their options: gopen's default one must be this test's."""
    KSpeedFileSystem.clear_instance_cache()
    yield
    KSpeedFileSystem.clear_instance_cache()


RICH = [
    (None, "x.jpg", "file", 700_000),
    ("a", "y.png", "file", 900_000),  # with 1 MiB segments: members straddle them
    ("a/c", "z", "file", 1200),
    ("a/c", "z", "file", 1300),  # replaces the one before
    ("a/c/" + "d" * 120, "f" * 150 + ".bin", "file", 333),
    ("a", "hard", "hardlink", 0),
    ("b", "sym", "symlink", 0),
    ("ünï", "é.txt", "file", 10),
    ("a", "", "dir", 0),
]


def shard_members(s: int) -> list[tuple[str, str, int]]:
    """(class, key, size) of the samples of shard s: two classes, webdataset keys."""
    return [(f"class{k % 2}", f"s{s}_{k:03d}", 1000 + 977 * k) for k in range(12)]


def image_tar(s: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for cls, key, size in shard_members(s):
            for ext, data in ((".jpg", os.urandom(size)), (".cls", cls.encode())):
                info = tarfile.TarInfo(f"{cls}/{key}{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture
def tar_source(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A dataset of tars beside their extraction: `tars/*.tar`, `extracted/<tar>/...`."""
    src = tmp_path / "src"
    tars = {
        "rich.tar": build_tar(RICH, tarfile.GNU_FORMAT, 1),
        "rich-pax.tar": build_tar(RICH, tarfile.PAX_FORMAT, 2),
        **{f"shard-{s:04d}.tar": image_tar(s) for s in range(3)},
    }
    for name, raw in tars.items():
        (src / "tars").mkdir(parents=True, exist_ok=True)
        (src / "tars" / name).write_bytes(raw)
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            tar.extractall(src / "extracted" / name, filter="fully_trusted")
    bad = bytearray(tars["shard-0001.tar"])
    bad[512 * 5 + 148] ^= 0x5A  # a later header's checksum
    (src / "damaged").mkdir()
    (src / "damaged" / "bad.tar").write_bytes(bad)
    return src, tars


@pytest.mark.slow
@pytest.mark.fuse
def test_tar_view_through_the_mount_and_kspeedfs_url(
    node: NodeProcess,
    tmp_path: Path,
    mounts: list[MountProcess],
    tar_source: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, tars = tar_source
    done = run_cli("preload", str(src), "--name", "tv", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(m)
    m.start()
    view = m.mountpoint / "tv@tar"
    wait_for(view.exists, 20, "the tar view")
    for name in tars:
        assert tree_of(view / "tars" / name) == tree_of(src / "extracted" / name), name
    assert os.listdir(view / "damaged" / "bad.tar") == []
    assert "bad.tar is shown empty" in m.log()
    # A member is no file of the dataset: it has no dataset attribute (not an EIO).
    member = next(p for p in (view / "tars" / "shard-0000.tar").rglob("*") if p.is_file())
    with pytest.raises(OSError) as no_attr:
        os.getxattr(member, "user.kspeedfs.dataset")
    assert no_attr.value.errno == errno.ENODATA
    assert (view / "extracted" / "rich.tar" / "x.jpg").read_bytes() == (
        src / "extracted" / "rich.tar" / "x.jpg"
    ).read_bytes()  # the rest of the dataset shows as it is
    # Stock ImageFolder over a shard folder equals the same over its extraction.
    from torchvision.datasets import DatasetFolder

    def load(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    for shard in ("shard-0000.tar", "shard-0002.tar"):
        over_view = DatasetFolder(str(view / "tars" / shard), load, extensions=(".jpg",))
        over_tree = DatasetFolder(str(src / "extracted" / shard), load, extensions=(".jpg",))
        assert over_view.classes == over_tree.classes
        assert [os.path.relpath(p, view / "tars" / shard) for p, _ in over_view.samples] == [
            os.path.relpath(p, src / "extracted" / shard) for p, _ in over_tree.samples
        ]
        assert [over_view[i] for i in range(len(over_view))] == [
            over_tree[i] for i in range(len(over_tree))
        ]

    # The fast path's view of one tar: DatasetFolder over its extraction, read from the cache.
    from pytorch_ext import KSpeedTarFolder

    for shard in ("shard-0000.tar", "shard-0001.tar"):
        fast = KSpeedTarFolder(
            src / "tars" / shard,
            loader=bytes,
            extensions=(".jpg",),
            objname="tv",
            nodes=node.address,
            token=node.token_file,
        )
        over_tree = DatasetFolder(str(src / "extracted" / shard), load, extensions=(".jpg",))
        assert fast.classes == over_tree.classes
        assert [os.path.relpath(p, src / "tars" / shard) for p, _ in fast.samples] == [
            os.path.relpath(p, src / "extracted" / shard) for p, _ in over_tree.samples
        ]
        assert [fast[i] for i in range(len(fast))] == [over_tree[i] for i in range(len(over_tree))]
    from torch.utils.data import DataLoader

    loader = DataLoader(fast, batch_size=5, num_workers=2, collate_fn=list)
    assert [s for batch in loader for s in batch] == [fast[i] for i in range(len(fast))]
    with pytest.raises(DataError):
        KSpeedTarFolder(src / "damaged" / "bad.tar", objname="tv", nodes=node.address,
                        token=node.token_file)  # fmt: skip

    # The same view through kspeedfs://, on the same node.
    fs = fsspec.filesystem(
        "kspeedfs", nodes=node.address, token=str(node.token_file), skip_instance_cache=True
    )
    for name in tars:
        base = f"tv@tar/tars/{name}"
        found = {}
        for path, info in fs.find(base, withdirs=True, detail=True).items():
            rel = os.fsencode(path[len(base) + 1 :])
            if not rel:
                continue  # the tar's own folder
            if info["type"] == "directory":
                found[rel] = ("dir", b"")
            elif info["type"] == "link":
                found[rel] = ("link", os.fsencode(info["destination"]))
            else:
                found[rel] = ("file", fs.cat_file(path))
                with fs.open(path) as f:
                    f.seek(info["size"] // 3)
                    assert f.read(100) == found[rel][1][info["size"] // 3 :][:100]
        assert found == tree_of(src / "extracted" / name), name
    assert fs.ls("tv@tar/damaged/bad.tar") == []

    # WebDataset opens kspeedfs:// URLs itself (gopen), once kspeedfs.stacks is imported.
    import webdataset as wds

    import kspeedfs.stacks  # noqa: F401

    monkeypatch.setenv("KSPEEDFS_NODES", node.address)  # gopen's filesystem: the defaults
    monkeypatch.setenv("KSPEEDFS_TOKEN_FILE", str(node.token_file))
    urls = "kspeedfs://tv/tars/shard-{0000..0002}.tar"
    local = str(src / "tars" / "shard-{0000..0002}.tar")
    got = [dict(s) for s in wds.WebDataset(urls, shardshuffle=False)]
    want = [dict(s) for s in wds.WebDataset(local, shardshuffle=False)]
    for s in got + want:
        s.pop("__url__")
        s.pop("__local_path__", None)
    assert got == want and len(got) == 36
