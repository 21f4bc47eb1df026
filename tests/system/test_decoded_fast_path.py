"""Decoded variants through the fast path (door 1 in docs/decoded.md):
KSpeedImageFolder(..., decoded=N) serves `Resize(N)(pil_loader(path))` from the node's decoded
pixels (PIL over the mapping, or a uint8 tensor view), the same classes, samples and targets as
ImageFolder, and decodes in the worker what is not decoded (yet, or here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NodeProcess, run_cli
from decoded_images import make_images
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import Resize

from kspeedfs.client import admin
from kspeedfs.client import decoded as decoded_client
from kspeedfs.format.config import load_settings
from kspeedfs.format.contract.decoded import VariantSummary
from pytorch_ext import KSpeedImageFolder
from pytorch_ext import transforms as kt

pytestmark = pytest.mark.slow  # image folders decoded on a node


@pytest.fixture
def loaded(node: NodeProcess, tmp_path: Path) -> Path:
    src = tmp_path / "images"
    make_images(src)
    r = run_cli("preload", str(src), "--name", "imgs", "-q", env=node.env())
    assert r.returncode == 0, r.stderr
    return src


def kw(node: NodeProcess) -> dict[str, Any]:
    return {"nodes": node.address, "token": str(node.token_file)}


def wait_variant(node: NodeProcess, size: int) -> VariantSummary:
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    with admin.connect(settings) as client:
        return decoded_client.wait(client, "imgs", size)


def expected(path: str, size: int) -> np.ndarray:
    img = pil_loader(path)
    return np.asarray(Resize(size)(img) if size else img)


def as_array(sample: Any) -> np.ndarray:
    if isinstance(sample, torch.Tensor):
        return sample.permute(1, 2, 0).numpy()
    assert isinstance(sample, Image.Image) and sample.mode == "RGB"
    return np.asarray(sample)


def check_all(ds: KSpeedImageFolder, ref: ImageFolder, size: int) -> None:
    assert ds.classes == ref.classes and ds.class_to_idx == ref.class_to_idx
    assert list(ds.samples) == ref.samples and list(ds.targets) == ref.targets
    for i, (path, target) in enumerate(ref.samples):
        if path.endswith("h_corrupt.jpg"):
            with pytest.raises(OSError) as ours:
                ds[i]
            with pytest.raises(OSError) as theirs:
                ref[i]
            assert type(ours.value) is type(theirs.value)
            assert str(ours.value) == str(theirs.value)
            continue
        sample, t = ds[i]
        assert t == target
        assert np.array_equal(as_array(sample), expected(path, size)), path


@pytest.mark.parametrize("size", [0, 64])
@pytest.mark.parametrize("decode", ["pil", "tensor"])
def test_decoded_samples_are_pixel_identical(
    node: NodeProcess, loaded: Path, size: int, decode: str
) -> None:
    ds = KSpeedImageFolder(loaded, decoded=size, decode=decode, **kw(node))
    v = wait_variant(node, size)
    assert v.files_done == v.files_total == 8 and v.undecodable == 1
    check_all(ds, ImageFolder(str(loaded)), size)
    variant = ds._variant()
    assert variant is not None  # served from the mapped pixels, not decoded here
    if decode == "tensor":
        sample, _ = ds[0]
        assert not sample.is_contiguous()  # a CHW view of the stored HWC pixels, no copy


def test_without_a_local_variant_the_worker_decodes(node: NodeProcess, loaded: Path) -> None:
    """local=False: nothing mapped, every sample decoded by the worker, the same pixels."""
    ds = KSpeedImageFolder(loaded, decoded=64, local=False, **kw(node))
    assert ds._variant() is None
    check_all(ds, ImageFolder(str(loaded)), 64)


def test_a_job_starting_during_the_fill_gets_correct_samples(
    node: NodeProcess, loaded: Path
) -> None:
    """The job reads right away, while the node decodes: each sample is either the node's
    pixels or decoded by the worker, identical either way."""
    ds = KSpeedImageFolder(loaded, decoded=32, decode="tensor", **kw(node))
    check_all(ds, ImageFolder(str(loaded)), 32)
    wait_variant(node, 32)
    check_all(ds, ImageFolder(str(loaded)), 32)


def valid(path: str) -> bool:
    return path.lower().endswith((".jpg", ".jpeg", ".png")) and "corrupt" not in path


def test_dataloader_epoch_with_workers(node: NodeProcess, loaded: Path) -> None:
    ref = ImageFolder(str(loaded), is_valid_file=valid)
    ds = KSpeedImageFolder(
        loaded,
        decoded=64,
        decode="tensor",
        is_valid_file=valid,
        transform=kt.train(24, scale=(1.0, 1.0), ratio=(1.0, 1.0)),
        **kw(node),
    )
    wait_variant(node, 64)
    assert list(ds.samples) == ref.samples
    loader = DataLoader(ds, batch_size=3, num_workers=2)
    batches = list(loader)
    images = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    assert images.dtype == torch.uint8 and images.shape == (len(ref), 3, 24, 24)
    assert targets.tolist() == ref.targets
    floats = kt.normalize(images)
    assert floats.dtype == torch.float32 and floats.shape == images.shape


def test_train_pipeline_on_pil_and_tensor() -> None:
    t = kt.train(16)
    pil = Image.new("RGB", (40, 30), (10, 20, 30))
    tensor = torch.zeros(30, 40, 3, dtype=torch.uint8).permute(2, 0, 1)
    for sample in (pil, tensor):
        out = t(sample)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8
        assert out.shape == (3, 16, 16)
    out = kt.train(16, normalize=True)(tensor)
    assert out.dtype == torch.float32
