"""The built-in end-to-end run: private node, sample, preload, mount, a table of loader rates."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from kspeedfs.client import admin
from kspeedfs.client import decoded as decoded_client
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.testing.cache import LocalCache

log = logging.getLogger(__name__)

SAMPLE_FILE_SIZE = "110KiB"
DECODED = 256  # the decoded variant's shorter side


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


def run_epoch(make: Callable[[], Any], workers: int, batch_size: int = 32) -> tuple[int, float]:
    """One epoch of DataLoader over the dataset `make` builds (its folder scan counted);
    returns (images, seconds)."""
    from torch.utils.data import DataLoader

    started = time.perf_counter()
    loader = DataLoader(
        make(), batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=False
    )
    images = 0
    for batch, _targets in loader:
        images += int(batch.shape[0])
    return images, time.perf_counter() - started


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


def _rows(source: Path, mountpoint: Path, cache: LocalCache) -> list[tuple[str, Callable[[], Any]]]:
    """The table's rows: (label, dataset maker), the stock baseline first."""
    from torchvision import datasets

    from pytorch_ext import KSpeedImageFolder
    from pytorch_ext import transforms as fast

    mounted = mountpoint / "sample" / source.name
    decoded = mountpoint / f"sample@{DECODED}" / source.name
    return [
        (
            "stock ImageFolder, source folder",
            lambda: datasets.ImageFolder(source, train_transform()),
        ),
        (
            "stock ImageFolder, over the mount",
            lambda: datasets.ImageFolder(mounted, train_transform()),
        ),
        (
            f"stock ImageFolder, the mount's sample@{DECODED} (decoded once)",
            lambda: datasets.ImageFolder(decoded, train_transform()),
        ),
        (
            f"fast path, decoded={DECODED} + transforms.train (uint8)",
            lambda: KSpeedImageFolder(
                str(source),
                fast.train(224),
                decoded=DECODED,
                decode="tensor",
                nodes=str(cache.address),
                token=str(cache.token_file),
            ),
        ),
    ]


def run_demo(workdir: Path, classes: int, per_class: int, workers: int) -> int:
    """Node, sample, preload (and its decoded variant), mount, one epoch per row of the table;
    0 on success."""
    logging.getLogger("torch").setLevel(logging.WARNING)  # its exit-time INFO lines are noise
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    source = ensure_sample(workdir / "sample", classes, per_class)
    data_bytes = _dir_bytes(source.parent)
    # Budget: the data, its pixels decoded at 256 (~1.8x the JPEGs), the manifest and slack.
    memory = 3 * data_bytes + (64 << 20)
    with _sigterm_as_interrupt(), LocalCache(workdir, memory) as cache:
        print(f"node on {cache.address}, shm {cache.shm_dir}, budget {format_size(memory)}")
        started = time.monotonic()
        cache.preload(source.parent, "sample")
        elapsed = time.monotonic() - started
        print(
            f"preloaded {format_size(data_bytes)} in {elapsed:.1f}s "
            f"({data_bytes / 1e6 / max(elapsed, 1e-9):.0f} MB/s)"
        )
        started = time.monotonic()
        with admin.connect(cache.settings) as client:
            decoded_client.start(client, "sample", DECODED)
            v = decoded_client.wait(client, "sample", DECODED)
        print(
            f"decoded {v.files_total} images at {DECODED} in {time.monotonic() - started:.1f}s "
            f"({format_size(v.bytes)} of pixels)"
        )
        mountpoint = workdir / "mnt"
        cache.mount(mountpoint)
        print(
            f"mounted at {mountpoint}; one epoch of DataLoader(num_workers={workers}, "
            "batch_size=32, shuffle) per row, the stock train transform unless said:"
        )
        results = []
        for label, make in _rows(source, mountpoint, cache):
            n, seconds = run_epoch(make, workers)
            results.append((label, n, seconds))
        base = results[0][1] / results[0][2]
        print(f"  {'DataLoader over':58s} {'images':>6s} {'images/s':>9s}  {'ratio':>6s}")
        for label, n, seconds in results:
            rate = n / seconds
            print(f"  {label:58s} {n:6d} {rate:9.0f}  {rate / base:5.2f}x")
        print(
            f"  (@{DECODED}: the node decoded each JPEG once, resized to a shorter side of "
            f"{DECODED}; the fast path hands out\n   those pixels without a copy, augments "
            "them as uint8 and leaves normalising to the GPU)"
        )
        cache.unmount(mountpoint)
        if len({n for _, n, _ in results}) != 1:
            raise KSpeedError("the rows disagree on the number of images")
    print("unmounted, node stopped")
    return 0
