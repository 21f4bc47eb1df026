"""Stock torchvision ImageFolder and DataLoader workers over a real mount versus the source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from kspeedfs.sample import make_sample

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # DataLoader workers over a mount

FIXED = transforms.Compose(
    [transforms.Resize(48), transforms.CenterCrop(40), transforms.ToTensor()]
)


@pytest.fixture
def images(tmp_path: Path) -> Path:
    src = tmp_path / "imagenet" / "train"
    make_sample(src, classes=4, per_class=6, file_size=6 * 1024, bases=4)
    return src


@pytest.fixture
def mounted_images(node: NodeProcess, images: Path, mount_all: MountProcess) -> Path:
    done = run_cli("preload", str(images.parent), "--name", "imagenet", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    train = mount_all.mountpoint / "imagenet" / "train"
    wait_for(train.exists, what="dataset on the mount")
    return train


def test_same_classes_samples_targets_and_tensors(images: Path, mounted_images: Path) -> None:
    src = datasets.ImageFolder(str(images), transform=FIXED)
    mnt = datasets.ImageFolder(str(mounted_images), transform=FIXED)
    assert len(src) == 24
    assert mnt.classes == src.classes
    assert mnt.class_to_idx == src.class_to_idx
    assert mnt.targets == src.targets
    assert [(os.path.relpath(p, mounted_images), t) for p, t in mnt.samples] == [
        (os.path.relpath(p, images), t) for p, t in src.samples
    ]
    for i in range(len(src)):
        a, ta = src[i]
        b, tb = mnt[i]
        assert ta == tb
        assert a.shape == (3, 40, 40)
        assert torch.equal(a, b), f"tensor {i} differs"


def test_dataloader_with_two_workers_runs_an_epoch(images: Path, mounted_images: Path) -> None:
    mnt = datasets.ImageFolder(str(mounted_images), transform=FIXED)
    loader = DataLoader(mnt, batch_size=5, shuffle=True, num_workers=2)
    seen: list[int] = []
    batches = 0
    for x, y in loader:
        assert x.shape[1:] == (3, 40, 40)
        seen.extend(y.tolist())
        batches += 1
    assert batches == 5
    assert sorted(seen) == sorted(datasets.ImageFolder(str(images)).targets)
