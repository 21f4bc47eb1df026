"""Decoded variants through the mount (door 2 in docs/decoded.md): the mount's `NAME@N/`
folder shows every image as a binary PPM of `Resize(N)(pil_loader(path))`, so stock ImageFolder
on it gets the source's classes, samples (with the extension mapping) and targets, and
pixel-identical images; undecodable files fail as they fail on the source; the folder goes with
its instance."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from decoded_images import _noise, make_images
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import pil_loader

from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import decoded as fmt
from kspeedfs.format.config import load_settings
from kspeedfs.fuse.variants import VariantFiles

pytestmark = pytest.mark.slow  # image folders decoded on a node, mounted


def make_folder_images(root: Path) -> dict[str, str]:
    """decoded_images' folder, plus a JPEG whose header reads but whose pixels do not decode,
    and two images sharing a stem (shown as `a.jpg.ppm` and `a.png.ppm`)."""
    kinds = make_images(root)
    buf = io.BytesIO()
    _noise(90, 70, "RGB", 9).save(buf, "JPEG", quality=95)
    (root / "dog" / "i_truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    kinds["dog/i_truncated.jpg"] = "truncated"
    _noise(30, 20, "RGB", 10).save(root / "cat" / "a.png", "PNG")
    kinds["cat/a.png"] = "png-same-stem"
    return kinds


def shown(rel: str, kinds: dict[str, str]) -> str:
    """Where the mount's variant folder shows a source file (the extension mapping)."""
    if kinds[rel] == "text":
        return rel
    stem = rel.rsplit(".", 1)[0]
    same_stem = [r for r in kinds if kinds[r] != "text" and r.rsplit(".", 1)[0] == stem]
    return (stem if len(same_stem) == 1 else rel) + ".ppm"


def expected(path: Path, size: int) -> np.ndarray:
    img = pil_loader(str(path))
    return np.asarray(transforms.Resize(size)(img) if size else img)


def failure(load: Any, path: Path) -> tuple[type, str]:
    with pytest.raises(Exception) as e:  # noqa: PT011 - whatever the source's failure is
        load(str(path))
    return type(e.value), str(e.value).replace(str(path), "PATH")


@pytest.fixture
def images(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "images"
    return root, make_folder_images(root)


def preload(node: NodeProcess, src: Path, *extra: str) -> None:
    r = run_cli("preload", str(src), "--name", "imgs", "-q", *extra, env=node.env())
    assert r.returncode == 0, r.stderr


def check_folder(folder: Path, src: Path, kinds: dict[str, str], size: int) -> None:
    """Every file of the source through the variant folder, against the source."""
    for rel, kind in kinds.items():
        path = folder / shown(rel, kinds)
        if kind == "text":
            assert path.read_bytes() == (src / rel).read_bytes()
        elif kind in ("corrupt", "truncated"):
            assert failure(pil_loader, path) == failure(pil_loader, src / rel), rel
            assert path.read_bytes() == (src / rel).read_bytes()  # the original bytes
        else:
            data = path.read_bytes()
            assert data.startswith(b"P6\n") and len(data) == os.stat(path).st_size
            with Image.open(path) as img:
                assert img.format == "PPM" and img.mode == "RGB"
            got = np.asarray(pil_loader(str(path)))
            assert np.array_equal(got, expected(src / rel, size)), rel
    assert not (folder / "cat" / "a.jpg").exists()  # images are shown under .ppm names only


def check_image_folder(folder: Path, src: Path, kinds: dict[str, str]) -> None:
    ours, ref = ImageFolder(str(folder)), ImageFolder(str(src))
    assert ours.classes == ref.classes and ours.class_to_idx == ref.class_to_idx
    mapped = [(str(folder / shown(os.path.relpath(p, src), kinds)), t) for p, t in ref.samples]
    assert ours.samples == mapped
    assert ours.targets == ref.targets


@pytest.mark.parametrize("size", [0, 64])
def test_decoded_folder_pixel_identical_through_the_mount(
    node: NodeProcess,
    images: tuple[Path, dict[str, str]],
    mounts: list[MountProcess],
    tmp_path: Path,
    size: int,
) -> None:
    src, kinds = images
    preload(node, src, "--decoded", str(size))
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path).start()
    mounts.append(mount)
    folder = mount.mountpoint / f"imgs@{size}"
    assert sorted(os.listdir(mount.mountpoint)) == ["imgs", f"imgs@{size}"]
    assert sorted(os.listdir(folder / "cat")) == [
        "a.jpg.ppm",
        "a.png.ppm",
        "b.ppm",
        "c.ppm",
        "d.ppm",
    ]
    check_folder(folder, src, kinds, size)
    check_image_folder(folder, src, kinds)
    # every sample through stock ImageFolder, against Resize(N) after decoding the originals
    ours, ref = ImageFolder(str(folder)), ImageFolder(str(src))
    for i, (path, _target) in enumerate(ref.samples):
        if kinds[os.path.relpath(path, src)] in ("corrupt", "truncated"):
            with pytest.raises(OSError):
                ours[i]
            continue
        assert np.array_equal(np.asarray(ours[i][0]), expected(Path(path), size)), path
    assert "ERROR" not in mount.log()


def valid(path: str) -> bool:
    return "corrupt" not in path and "truncated" not in path and not path.endswith(".txt")


def test_dataloader_epoch_with_two_workers_over_the_mount(
    node: NodeProcess, images: tuple[Path, dict[str, str]], mount_all: MountProcess
) -> None:
    src, _kinds = images
    preload(node, src, "--decoded", "64")
    crop = transforms.Compose([transforms.CenterCrop(16), transforms.PILToTensor()])
    ours = ImageFolder(str(mount_all.mountpoint / "imgs@64"), transform=crop, is_valid_file=valid)
    ref = ImageFolder(
        str(src),
        transform=transforms.Compose([transforms.Resize(64), crop]),
        is_valid_file=valid,
    )
    assert len(ours) == len(ref) == 8
    batches = list(DataLoader(ours, batch_size=4, num_workers=2))
    want = list(DataLoader(ref, batch_size=4, num_workers=0))
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.cat([b[0] for b in want]))
    assert torch.cat([b[1] for b in batches]).tolist() == ref.targets


def test_samples_not_decoded_here_are_decoded_on_demand(
    node: NodeProcess, images: tuple[Path, dict[str, str]]
) -> None:
    """No local variant (a process that maps nothing): every image is decided by the mount's
    own decode, with the node's rule, and gives the same bytes as the node's PPM."""
    src, kinds = images
    preload(node, src, "--decoded", "64")
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    reader = ClusterReader(settings, None)
    try:
        data = reader.open_dataset("imgs")
        assert data.local is None
        on_demand = VariantFiles(reader, data, 64)
        assert on_demand.local is None
        node_side = fmt.DecodedVariant(node.shm_dir / "datasets" / "imgs" / "decoded-64", data.uuid)
        m = data.manifest
        for rel, kind in kinds.items():
            idx = m.resolve(rel)
            assert on_demand.name(idx).decode() == shown(rel, kinds).rsplit("/", 1)[1]
            size, final = on_demand.file_size(idx, decide=True)
            assert final
            got = on_demand.read(idx, 0, 1 << 30)
            if callable(got):
                got = got()
            if kind == "text" or node_side.state(idx) == fmt.UNDECODABLE:
                assert got is None and size == (src / rel).stat().st_size, rel
                continue
            assert kind not in ("corrupt", "truncated")
            assert got is not None and bytes(got) == bytes(node_side.ppm(idx)), rel
            assert size == len(got)
    finally:
        reader.close()


def test_a_mount_reading_during_the_fill_gets_correct_samples(
    node: NodeProcess, images: tuple[Path, dict[str, str]], mount_all: MountProcess
) -> None:
    """The variant folder appears once the index is written; samples not decoded yet are
    decoded by the mount, identical either way."""
    src, kinds = images
    for i in range(40):  # enough for the fill to take a while
        _noise(700, 500, "RGB", 100 + i).save(src / "cat" / f"z{i:02d}.jpg", "JPEG")
        kinds[f"cat/z{i:02d}.jpg"] = "jpeg"
    preload(node, src)
    node.request("decode", name="imgs", size=48)
    folder = mount_all.mountpoint / "imgs@48"
    wait_for(folder.exists, what="the variant folder")
    check_folder(folder, src, kinds, 48)
    check_image_folder(folder, src, kinds)


def test_unload_removes_the_variant_folder(
    node: NodeProcess, images: tuple[Path, dict[str, str]], mount_all: MountProcess
) -> None:
    src, kinds = images
    preload(node, src, "--decoded", "32")
    folder = mount_all.mountpoint / "imgs@32"
    check_folder(folder, src, kinds, 32)
    assert run_cli("unload", "imgs", env=node.env()).returncode == 0
    wait_for(lambda: not folder.exists(), what="imgs@32 gone")
    assert os.listdir(mount_all.mountpoint) == []
    preload(node, src)  # loaded again without the variant: no folder for it
    wait_for(lambda: (mount_all.mountpoint / "imgs").exists(), what="imgs back")
    assert not folder.exists()


def test_mount_of_one_variant_at_the_root_starts_it_and_serves_what_name_at_n_serves(
    node: NodeProcess,
    images: tuple[Path, dict[str, str]],
    mounts: list[MountProcess],
    mount_all: MountProcess,
    tmp_path: Path,
) -> None:
    """`mount --dataset imgs@64` (what a CSI volume with decoded=64 declares): the dataset was
    loaded without the variant, the mount starts it, and its root is the tree the
    all-datasets mount shows under imgs@64/, byte for byte; stock ImageFolder reads it."""
    src, kinds = images
    preload(node, src)
    assert node.request("decode_status", name="imgs")["variants"] == {}
    mount = MountProcess(tmp_path / "one", node.env(), tmp_path, ("--dataset", "imgs@64"))
    mounts.append(mount.start())
    assert "64" in node.request("decode_status", name="imgs")["variants"]  # started by the mount
    root = mount.mountpoint
    assert sorted(os.listdir(root)) == sorted(os.listdir(src))
    assert sorted(os.listdir(root / "cat")) == ["a.jpg.ppm", "a.png.ppm", "b.ppm", "c.ppm", "d.ppm"]
    check_folder(root, src, kinds, 64)
    check_image_folder(root, src, kinds)
    wait_for(lambda: (mount_all.mountpoint / "imgs@64").exists(), what="imgs@64 on mount_all")
    beside = mount_all.mountpoint / "imgs@64"
    for dirpath, _dirs, files in os.walk(beside):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), beside)
            assert (root / rel).read_bytes() == (beside / rel).read_bytes(), rel
    assert "ERROR" not in mount.log()


@pytest.mark.parametrize("name", ["imgs@", "imgs@x", "imgs@65536", "@64", "imgs@64@1"])
def test_mount_refuses_a_malformed_variant_name(name: str) -> None:
    from kspeedfs.format.errors import InvalidArgument
    from kspeedfs.format.names import split_variant, validate_mount_name

    with pytest.raises(InvalidArgument):
        validate_mount_name(name)
    assert split_variant("imgs@64") == ("imgs", 64) and split_variant("imgs") == ("imgs", None)
