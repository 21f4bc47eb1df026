"""What bounds door 2: stock ImageFolder on a mount's `NAME@N/` folder against the same with an
unbuffered loader (no isatty(), so no FUSE IOCTL per open) and against door 1.

    .venv/bin/python bench/bench_decoded_mount.py [--rounds 2]

Reuses the image set bench/bench_decoded.py generated (run that first). Prints epoch-2 images/s
of each loader with 2 DataLoader workers, round after round (the machine is noisy: compare
within a round). Python 3.11-3.13's default open() asks isatty() of every file, which on a FUSE
mount is one IOCTL request the kernel never caches; the unbuffered loader shows its cost.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision import datasets, transforms  # noqa: E402

from kspeedfs.client import admin  # noqa: E402
from kspeedfs.client import decoded as decoded_client  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import KSpeedImageFolder  # noqa: E402

SOURCE = Path("/var/tmp/kspeedfs-bench-decoded/set-20x100-110KiB/train")
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def train_transform() -> transforms.Compose:
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


def unbuffered_loader(path: str) -> Image.Image:
    with open(path, "rb", buffering=0) as f:  # no isatty(): no FUSE IOCTL for this open
        return Image.open(f).convert("RGB")


def epoch2(ds: Dataset[Any]) -> float:
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
    for _ in loader:
        pass
    started, n = time.perf_counter(), 0
    for _x, y in loader:
        n += len(y)
    return n / (time.perf_counter() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", type=Path, default=SOURCE)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not args.source.is_dir():
        raise SystemExit(f"{args.source} is missing: run bench/bench_decoded.py first")
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-decoded-mount-"))
    with LocalCache(work, 3 << 30) as node:
        node.preload(args.source.parent, "bench", show_progress=False)
        with admin.connect(node.settings) as client:
            decoded_client.start(client, "bench", args.size)
            decoded_client.wait(client, "bench", args.size)
        mount = node.mount(work / "mnt")
        root = str(mount.mountpoint / f"bench@{args.size}" / args.source.name)
        door1 = KSpeedImageFolder(
            str(args.source),
            transform=train_transform(),
            decoded=args.size,
            nodes=str(node.address),
            token=str(node.token_file),
        )
        loaders: dict[str, Dataset[Any]] = {
            "door 2, stock ImageFolder": datasets.ImageFolder(root, train_transform()),
            "door 2, unbuffered open (no IOCTL)": datasets.ImageFolder(
                root, train_transform(), loader=unbuffered_loader
            ),
            "door 1, stock transform": door1,
        }
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}: epoch 2, 2 DataLoader workers, batch 32")
            for label, ds in loaders.items():
                print(f"  {label:38s} {epoch2(ds):7.0f} img/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
