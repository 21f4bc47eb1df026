"""The built-in end-to-end run: private node, sample dataset, preload, mount, ImageFolder epochs."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.localproc import LocalCache

log = logging.getLogger(__name__)

SAMPLE_FILE_SIZE = "110KiB"


def train_transform() -> Any:
    """The standard ImageNet training transform."""
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )


def run_epoch(root: Path, workers: int, batch_size: int = 32) -> tuple[int, float, list[str]]:
    """One epoch of stock ImageFolder + DataLoader; returns (images, seconds, classes)."""
    from torch.utils.data import DataLoader
    from torchvision import datasets

    started = time.perf_counter()
    dataset = datasets.ImageFolder(str(root), transform=train_transform())
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=False,
    )
    images = 0
    for batch, _targets in loader:
        images += int(batch.shape[0])
    return images, time.perf_counter() - started, list(dataset.classes)


def ensure_sample(dest: Path, classes: int, per_class: int, size: str = SAMPLE_FILE_SIZE) -> Path:
    """Generate the sample under dest/train once; a stamp records what was made."""
    from kspeedfs.sample import make_sample

    stamp = dest.with_name(dest.name + ".json")  # beside it: not part of the dataset
    want = {"classes": classes, "per_class": per_class, "size": size}
    try:
        if json.loads(stamp.read_text()) == want:
            print(f"reusing the sample dataset in {dest}")
            return dest / "train"
    except (OSError, ValueError):
        pass
    shutil.rmtree(dest, ignore_errors=True)
    started = time.monotonic()
    n, nbytes = make_sample(dest / "train", classes, per_class, parse_size(size))
    stamp.write_text(json.dumps(want))
    print(
        f"generated {n} images ({format_size(nbytes)}) in {dest} "
        f"in {time.monotonic() - started:.1f}s"
    )
    return dest / "train"


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the cleanup below runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(workdir: Path, classes: int, per_class: int, workers: int) -> int:
    """Node, sample, preload, mount, one epoch over each of mount and source; 0 on success."""
    logging.getLogger("torch").setLevel(logging.WARNING)  # its exit-time INFO lines are noise
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    source = ensure_sample(workdir / "sample", classes, per_class)
    data_bytes = _dir_bytes(source.parent)
    # Budget: the data, its manifest and slack; the node refuses more than fits in shm.
    memory = data_bytes + data_bytes // 10 + (64 << 20)
    with _sigterm_as_interrupt(), LocalCache(workdir, memory) as cache:
        print(f"node on {cache.address}, shm {cache.shm_dir}, budget {format_size(memory)}")
        started = time.monotonic()
        cache.preload(source.parent, "sample")
        elapsed = time.monotonic() - started
        print(
            f"preloaded {format_size(data_bytes)} in {elapsed:.1f}s "
            f"({data_bytes / 1e6 / max(elapsed, 1e-9):.0f} MB/s)"
        )
        mountpoint = workdir / "mnt"
        cache.mount(mountpoint)
        mounted = mountpoint / "sample" / "train"
        print(f"mounted at {mountpoint}; ImageFolder + DataLoader(num_workers={workers}) epochs:")
        results = {}
        for label, root in (("source", source), ("mount", mounted)):
            n, seconds, found = run_epoch(root, workers)
            results[label] = (n, seconds, found)
            print(f"  {label:<6} {root}: {n} images in {seconds:.1f}s = {n / seconds:.0f} images/s")
        (n_src, s_src, c_src), (n_mnt, s_mnt, c_mnt) = results["source"], results["mount"]
        print(f"  mount/source: {(n_mnt / s_mnt) / (n_src / s_src):.2f}")
        cache.unmount(mountpoint)
        if (n_src, c_src) != (n_mnt, c_mnt):
            raise KSpeedError("the mount and the source disagree on the images or classes")
    print("unmounted, node stopped")
    return 0
