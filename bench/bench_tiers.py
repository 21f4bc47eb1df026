"""Read-through over a dataset twice the memory budget: the eviction policies side by side,
without and with a disk tier.

    .venv/bin/python bench/bench_tiers.py [--files 1200] [--size 110KiB] [--memory half]

One node per policy (`lru`, `stable`, `plan`), a read-through dataset of JPEGs twice its
memory budget (the budget is half the dataset rounded up to whole segments, plus room for the
manifest), three shuffled epochs with 2 DataLoader workers (a) through the fast path
(KSpeedImageFolder, decode="tensor", with a ClairvoyantSampler: its prefetcher sends the plan
to the node), (b) through `kspeedfs mount --source` (a fresh mount every epoch, so the
kernel's page cache does not hide the daemon; the mount sends no plan: `plan` there is
`stable`), and (c) the fast path with a PrioritySampler's draws (even weights, with
replacement: samples repeat within an epoch, which a plan can use and a shuffle cannot).
Printed: the share of the dataset read from the source in each epoch (the node counts its
fills and the misses it did not keep, which the readers read) and images/s. Every byte is
compared with the source once per run (count of wrong bytes). Beside each row, the floor no
demand cache beats on a shuffle: 1 - resident bytes / dataset bytes (every sample is read
once an epoch, so a hit needs its segment resident when the epoch starts). Then the same
policies on a node with a disk tier (`--spill-dir`, `--spill` twice the dataset), through
the fast path and the mount: what memory does not keep lands on the disk tier (`lru` spills
its evictions there and copies them back). Targets: after the first epoch, stable <= 0.6
and plan <= 0.5 of the dataset from the source in memory alone, 0 with a disk tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_backends import warm_memory  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision.io import decode_jpeg  # noqa: E402

from kspeedfs.client import admin  # noqa: E402
from kspeedfs.demo import ensure_sample  # noqa: E402
from kspeedfs.format.layout import plan_layout  # noqa: E402
from kspeedfs.format.units import format_size, parse_size  # noqa: E402
from kspeedfs.sources.loader import manifest_size_estimate  # noqa: E402
from kspeedfs.sources.source import open_source  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import ClairvoyantSampler, KSpeedImageFolder, PrioritySampler  # noqa: E402

POLICIES = ("lru", "stable", "plan")
EPOCHS = 3
TARGETS = {"stable": 0.6, "plan": 0.5}
FLOOR_SLACK = 0.01  # a share within this of the floor is at it (segments are whole)
MEMORY, DISK = "memory", "memory+disk"
PAGE = 4096


@dataclasses.dataclass
class Row:
    policy: str
    tier: str
    path: str
    shares: list[float]  # of the dataset read from the source, per epoch
    rate: float  # images/s
    floor: float  # 1 - resident / dataset: the least a shuffle reads from the source


def half_budget(source: Path, segment_size: int) -> int:
    """Half the dataset rounded up to whole segments, plus its manifest and side files."""
    tree = open_source(str(source)).scan()
    _offsets, seg_len = plan_layout(tree, segment_size)
    half = -(-tree.data_bytes // (2 * segment_size)) * segment_size
    base = manifest_size_estimate(tree) + 8 * len(seg_len) + 8
    return half + -(-base // PAGE) * PAGE


def floor(cache: LocalCache, name: str, total: int) -> float:
    """1 - the bytes the node holds of `name` (memory and its disk tier) / the dataset's."""
    d = cache.request("status")["cache"]["datasets"][name]
    held = int(d.get("resident_bytes", d["memory_bytes"])) + int(d.get("disk_bytes", 0))
    return max(0.0, 1 - held / total)


class MountedFiles(Dataset[Any]):
    """The files under a mount, decoded as the fast path decodes them (torchvision.io)."""

    def __init__(self, root: Path, rels: list[str]):
        self.root = root
        self.rels = rels

    def __len__(self) -> int:
        return len(self.rels)

    def __getitem__(self, i: int) -> Any:
        data = (self.root / self.rels[i]).read_bytes()
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)), i


def source_share(cache: LocalCache, name: str, total: int) -> Callable[[], float]:
    """A counter of the dataset's source bytes since the last call, as a share of `total`."""
    seen = [0]

    def delta() -> float:
        now = int(cache.request("status")["cache"]["datasets"][name]["source_bytes"])
        share, seen[0] = (now - seen[0]) / total, now
        return share

    return delta


def fast_path_epochs(
    cache: LocalCache, source: Path, name: str, total: int, sampler: str, workers: int
) -> tuple[list[float], float, float]:
    admin.register_source(cache.settings, str(source), name=name)
    ds = KSpeedImageFolder(
        source, objname=name, nodes=str(cache.address), token=cache.token_file, decode="tensor"
    )
    delta = source_share(cache, name, total)
    shares, images, seconds = [], 0, 0.0
    for epoch in range(EPOCHS):
        order: ClairvoyantSampler
        if sampler == "draws":
            order = PrioritySampler(ds, np.ones(len(ds)), seed=1, depth=4)
        else:
            order = ClairvoyantSampler(ds, seed=1, depth=4)
        order.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=32, sampler=order, num_workers=workers, collate_fn=list)
        started = time.perf_counter()
        for batch in loader:
            images += len(batch)
        seconds += time.perf_counter() - started
        shares.append(delta())
    least = floor(cache, name, total)
    cache.request("unload", name=name)
    return shares, images / seconds, least


def mount_epochs(
    cache: LocalCache, source: Path, name: str, total: int, workdir: Path, workers: int
) -> tuple[list[float], float, float]:
    rels = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    mnt = workdir / "mnt"
    delta: Callable[[], float] | None = None
    shares, images, seconds = [], 0, 0.0
    for epoch in range(EPOCHS):
        cache.mount(mnt, "--source", str(source), "--name", name)
        try:
            if delta is None:
                delta = source_share(cache, name, total)
            g = torch.Generator().manual_seed(epoch)
            loader = DataLoader(
                MountedFiles(mnt, rels),
                batch_size=32,
                shuffle=True,
                generator=g,
                num_workers=workers,
                collate_fn=list,
            )
            started = time.perf_counter()
            for batch in loader:
                images += len(batch)
            seconds += time.perf_counter() - started
        finally:
            cache.unmount(mnt)
        shares.append(delta())
    least = floor(cache, name, total)
    cache.request("unload", name=name)
    return shares, images / seconds, least


def wrong_bytes(cache: LocalCache, source: Path, name: str) -> int:
    """Every file once through the fast path, compared with the source."""
    admin.register_source(cache.settings, str(source), name=name)
    ds = KSpeedImageFolder(source, objname=name, nodes=str(cache.address), token=cache.token_file)
    wrong = 0
    for i in random.Random(2).sample(range(len(ds)), len(ds)):
        path, _ = ds.samples[i]
        got = np.frombuffer(bytes(ds._bytes(ds._sample(i)[0])), dtype=np.uint8)
        want = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
        wrong += int(np.count_nonzero(got != want)) if len(got) == len(want) else len(want)
    cache.request("unload", name=name)
    return wrong


def run_policy(
    args: argparse.Namespace,
    source: Path,
    total: int,
    memory: int,
    policy: str,
    tier: str,
) -> tuple[list[Row], int]:
    """One node of `policy` (with a disk tier twice the dataset for DISK): its rows, and the
    wrong bytes of one pass compared with the source."""
    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-tiers-"))
    extra: tuple[str, ...] = ("--eviction", policy)
    paths = ["fast path", "mount", "fast path, draws"]
    if tier == DISK:
        extra += ("--spill-dir", str(workdir / "disk"), "--spill", str(2 * total))
        paths = ["fast path", "mount"]
    rows = []
    with LocalCache(workdir, memory, segment_size=args.segment_size, extra=extra) as cache:
        for path in paths:
            warm_memory(2 * total)
            if path == "mount":
                got = mount_epochs(cache, source, "viamount", total, workdir, args.workers)
            else:
                sampler = "draws" if "draws" in path else "shuffle"
                got = fast_path_epochs(cache, source, "fast", total, sampler, args.workers)
            row = Row(policy, tier, path, *got)
            rows.append(row)
            shares = " ".join(f"{x:.2f}" for x in row.shares)
            print(
                f"  {policy:6s} {tier:12s} {path:17s} {shares}  {row.rate:.0f} images/s  "
                f"(floor {row.floor:.2f})",
                flush=True,
            )
        wrong = wrong_bytes(cache, source, "check")
    return rows, wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=1200, help="number of files (default 1200)")
    p.add_argument("--classes", type=int, default=12)
    p.add_argument("--size", default="110KiB", help="approximate file size")
    p.add_argument(
        "--memory",
        default="half",
        help="the node's budget (default half: half the dataset in whole segments, + manifest)",
    )
    p.add_argument("--segment-size", default="1MiB")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench", help="where the data set is kept")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # decode="tensor" hands torch a read-only view of the cache: what it warns about is meant.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")

    per_class = max(1, args.files // args.classes)
    source = ensure_sample(
        Path(args.cache) / f"set-{args.classes}x{per_class}-{args.size}",
        args.classes,
        per_class,
        args.size,
    )
    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    segment_size = parse_size(args.segment_size)
    memory = half_budget(source, segment_size) if args.memory == "half" else parse_size(args.memory)
    print(
        f"data set: {per_class * args.classes} files, {format_size(total)} "
        f"({total / memory:.2f}x the {format_size(memory)} budget); segments of "
        f"{args.segment_size}; {EPOCHS} epochs, {args.workers} workers; {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    rows: list[Row] = []
    wrong = 0
    for tier in (MEMORY, DISK):
        for policy in POLICIES:
            got, bad = run_policy(args, source, total, memory, policy, tier)
            rows += got
            wrong += bad
    print()
    print(
        f"{'policy':8s}{'tier':14s}{'path':19s}"
        + "".join(f"epoch {e + 1:<5d}" for e in range(EPOCHS))
        + f"{'images/s':>10s}  floor"
    )
    for row in rows:
        cells = "".join(f"{s:<11.2f}" for s in row.shares)
        print(
            f"{row.policy:8s}{row.tier:14s}{row.path:19s}{cells}{row.rate:10.0f}  {row.floor:.2f}"
        )
    print("(share of the dataset read from the source in each epoch; floor: 1 - resident/dataset)")
    print()
    for row in rows:
        after = max(row.shares[1:])
        if row.tier == MEMORY and row.path.startswith("fast path") and row.policy in TARGETS:
            target = TARGETS[row.policy]
        elif row.tier == DISK and row.policy != "lru":
            target = 0.0
        else:
            continue
        if after <= target:
            verdict = "ok"
        elif after <= row.floor + FLOOR_SLACK:
            # Every sample is read once an epoch: a hit needs it resident when the epoch
            # starts, so no demand cache reads less than the floor on a shuffle.
            verdict = "at the floor (no policy reads less on a shuffle)"
        else:
            verdict = "MISSED"
        print(
            f"{row.policy} {row.tier} {row.path}: {after:.2f} after the first epoch "
            f"(target <= {target}, floor {row.floor:.2f}): {verdict}"
        )
    print(f"wrong bytes: {wrong}")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
