"""The merged tar view (`NAME@untar/`) through its three doors, on one node and one mount.

Random trees split over random shards (members of one folder in many shards, the same path in
several, long names, nested folders, links), preloaded: the mount, `kspeedfs://` and the fast
path (`KSpeedUntarFolder`) show what GNU tar gives extracting every shard in path order, byte
for byte and name for name. Stock ImageFolder over the view equals ImageFolder over the
extraction; a damaged shard among good ones is one log line, its members absent, the rest
served.
"""

from __future__ import annotations

import io
import itertools
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import MountProcess, NodeProcess, kw, node_in, preload, wait_for
from hypothesis import HealthCheck, given, settings
from untarutil import extract_in_order, shard_tars, shards_st, tree_of, write_shards

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.stacks.filesystem import KSpeedFileSystem
from pytorch_ext import KSpeedImageFolder, KSpeedUntarFolder

pytestmark = [pytest.mark.slow, pytest.mark.fuse]
EXTENSIONS = (".jpg", ".png")
_names = itertools.count()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the module: each test preloads datasets under names of their own."""
    with node_in(tmp_path_factory.mktemp("untar")) as n:
        yield n


@pytest.fixture(scope="module")
def mount(node: NodeProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MountProcess]:
    folder = tmp_path_factory.mktemp("untar-mount")
    m = MountProcess(folder / "mnt", node.env(), folder)
    m.start()
    # The mount checks its root lists what the node holds before it says it is mounted: a
    # dataset preloaded during that check can fail it (the mount then exits), so wait.
    wait_for(lambda: "served by" in m.log(), 30, "the mount's own check")
    yield m
    m.stop()


@pytest.fixture(scope="module")
def fs(node: NodeProcess) -> Any:
    KSpeedFileSystem.clear_instance_cache()
    return fsspec.filesystem(
        "kspeedfs", nodes=node.address, token=str(node.token_file), skip_instance_cache=True
    )


def loaded(node: NodeProcess, tars: dict[str, bytes], folder: Path) -> str:
    """The shards written under `folder`/src and preloaded; the dataset's name."""
    name = f"u{next(_names)}"
    write_shards(folder / "src", tars)
    preload(node, folder / "src", name)
    return name


def fsspec_tree(fs: Any, top: str) -> dict[bytes, tuple[str, bytes]]:
    out: dict[bytes, tuple[str, bytes]] = {}
    for path, info in fs.find(top, withdirs=True, detail=True).items():
        rel = os.fsencode(path[len(top) + 1 :])
        if not rel:
            continue
        if info["type"] == "directory":
            out[rel] = ("dir", b"")
        elif info["type"] == "link":
            out[rel] = ("link", os.fsencode(info["destination"]))
        else:
            out[rel] = ("file", fs.cat_file(path))
    return out


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def folder_samples(ds: Any, root: Path | str) -> list[tuple[str, int]]:
    return [(os.path.relpath(p, root), t) for p, t in ds.samples]


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(drawn=shards_st)
def test_merged_view_equals_extraction_through_every_door(
    drawn: Any,
    node: NodeProcess,
    mount: MountProcess,
    fs: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from torchvision.datasets import DatasetFolder

    tars = shard_tars(*drawn)
    folder = tmp_path_factory.mktemp("drawn")
    name = loaded(node, tars, folder)
    want = tree_of(extract_in_order(tars, folder / "extracted"))
    view = mount.mountpoint / f"{name}@untar"
    wait_for(view.exists, 20, "the merged view")
    assert tree_of(view) == want
    assert fsspec_tree(fs, f"{name}@untar") == want
    try:
        over_tree = DatasetFolder(str(folder / "extracted"), read_bytes, extensions=EXTENSIONS)
    except FileNotFoundError:
        return  # no class folder holds an image: DatasetFolder refuses both
    fast = KSpeedUntarFolder(
        folder / "src", loader=bytes, extensions=EXTENSIONS, objname=name, **kw(node)
    )
    assert fast.classes == over_tree.classes
    assert folder_samples(fast, folder / "src") == folder_samples(over_tree, folder / "extracted")
    assert [fast[i] for i in range(len(fast))] == [over_tree[i] for i in range(len(over_tree))]


def image_shards(count: int, per_class: int) -> dict[str, bytes]:
    """ImageFolder's layout over `count` shards, each holding a slice of every class; the
    last shard repeats one image of the first with other pixels (it replaces it)."""
    from PIL import Image

    tars: dict[str, bytes] = {}
    for s in range(count):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for cls in ("cat", "dog", "emu"):
                for k in range(per_class):
                    key = 0 if s == count - 1 and k == 0 else s * per_class + k
                    img = io.BytesIO()
                    Image.new("RGB", (7 + k, 5 + s), (s * 40, k * 20, len(cls))).save(img, "PNG")
                    info = tarfile.TarInfo(f"train/{cls}/{key:04d}.png")
                    info.size = img.tell()
                    img.seek(0)
                    tar.addfile(info, img)
        tars[f"shard-{s:04d}.tar"] = buf.getvalue()
    return tars


def test_stock_imagefolder_over_the_view_equals_it_over_the_extraction(
    node: NodeProcess, mount: MountProcess, tmp_path: Path
) -> None:
    from torchvision.datasets import ImageFolder

    tars = image_shards(4, 3)
    name = loaded(node, tars, tmp_path)
    extracted = extract_in_order(tars, tmp_path / "extracted") / "train"
    view = mount.mountpoint / f"{name}@untar" / "train"
    wait_for(view.exists, 20, "the merged view")
    over_view, over_tree = ImageFolder(str(view)), ImageFolder(str(extracted))
    assert over_view.classes == over_tree.classes == ["cat", "dog", "emu"]
    assert folder_samples(over_view, view) == folder_samples(over_tree, extracted)
    assert len(over_view) == 3 * 11  # 4 shards of 3 per class, one image replaced
    for i in range(len(over_tree)):
        (a, ta), (b, tb) = over_view[i], over_tree[i]
        assert (a.size, a.tobytes(), ta) == (b.size, b.tobytes(), tb)
        assert read_bytes(over_view.samples[i][0]) == read_bytes(over_tree.samples[i][0])
    fast = KSpeedUntarFolder(tmp_path / "src", folder="train", objname=name, **kw(node))
    assert folder_samples(fast, tmp_path / "src" / "train") == folder_samples(over_tree, extracted)
    assert [fast[i][0].tobytes() for i in range(len(fast))] == [
        over_tree[i][0].tobytes() for i in range(len(over_tree))
    ]
    # The fast path given the view's folder on the mount: the same samples, read from the
    # cache (not back through FUSE); the other fast-path datasets refuse it in one line.
    on_view = KSpeedUntarFolder(view, loader=bytes, **kw(node))
    assert on_view.samples == over_view.samples
    assert [on_view[i][0] for i in range(len(on_view))] == [
        read_bytes(p) for p, _ in over_view.samples
    ]
    with pytest.raises(InvalidArgument, match="merged tar view"):
        KSpeedImageFolder(view, **kw(node))


def test_a_damaged_shard_is_one_line_and_the_others_are_served(
    node: NodeProcess, mount: MountProcess, fs: Any, tmp_path: Path
) -> None:
    good = image_shards(3, 2)
    bad = bytearray(good.pop("shard-0001.tar"))
    with tarfile.open(fileobj=io.BytesIO(bytes(bad))) as tar:
        second = tar.getmembers()[1].offset
    bad[second + 148] ^= 0x5A  # a later header's checksum: the shard is not a whole tar
    tars = {**good, "shard-0001.tar": bytes(bad)}
    name = loaded(node, tars, tmp_path)
    want = tree_of(extract_in_order(good, tmp_path / "extracted"))
    view = mount.mountpoint / f"{name}@untar"
    wait_for(view.exists, 20, "the merged view")
    assert tree_of(view) == want
    # One line from each serving process that built the view (a worker per CPU, at most 8).
    lines = [ln for ln in mount.log().splitlines() if f"{name}@untar" in ln and "left out" in ln]
    assert 1 <= len(lines) <= min(8, os.cpu_count() or 1), lines
    assert all("shard-0001.tar" in ln and "unreadable tar header" in ln for ln in lines), lines
    assert fsspec_tree(fs, f"{name}@untar") == want
    fast = KSpeedUntarFolder(tmp_path / "src", loader=bytes, objname=name, **kw(node))
    assert list(fast.refused) == [fast.shards.index("shard-0001.tar")]
    assert len(fast) == len([p for p in want if p.endswith(b".png")])
    with pytest.raises(InvalidArgument):
        KSpeedUntarFolder(tmp_path / "src", folder="nothing", objname=name, **kw(node))
