"""Disk-tier benchmark: reads of a dataset on the node's disk tier against one in memory.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_disk_tier.py [--files 2000] [--size 64KiB] [--epochs 3]

One node with a memory budget for one copy and a disk tier (`spill_dir`) for another: the same
source preloaded twice, `--tier memory` and `--tier disk`. Each side reads every file in a
shuffled order per epoch through the fast path (copied out, as a DataLoader's decode would
take it) and through the mount, on a warm page cache (the disk tier's files were just
written), alternating sides, memory warmed (touched and freed) before each. Target: the disk
tier's files/s at least 0.5 of memory's. After the first epoch the source folder is moved
away: every later epoch reads it whole, so not one byte of it came from the source.

"fast path" reads views (maps, zero-copy) and copies them out; "fast copy" is the fast path's
copying read (`gather`, what `fetch` and `scratch_view` do): from maps, while the instance has
fewer than localdata.MAPPED_SEGMENTS of them (then pread for disk-tier segments). The last lines copy every file of the disk tier both ways,
map and pread, from a fresh instance (as a new DataLoader worker would), on a warm page cache
and on a cold one (our segments' pages dropped with fadvise).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fuse import list_files, read_files  # noqa: E402

from kspeedfs.demo import ensure_sample  # noqa: E402
from kspeedfs.format.units import format_size  # noqa: E402
from kspeedfs.testing.bench import warm_memory  # noqa: E402
from kspeedfs.testing.mount import MountProcess  # noqa: E402
from kspeedfs.testing.node import NodeProcess, remove_tree  # noqa: E402
from kspeedfs.testing.process import KSPEEDFS  # noqa: E402
from pytorch_ext import KSpeedFolder  # noqa: E402

TARGET = 0.5
BUF = bytearray(64 << 20)


def read_fast(ds: KSpeedFolder, order: Sequence[int]) -> float:
    """Every file once through the fast path, its bytes copied out."""
    out = memoryview(BUF)
    started = time.perf_counter()
    for i in order:
        view = ds.read_index(i)
        out[: len(view)] = view
    return time.perf_counter() - started


def read_copied(ds: KSpeedFolder, entries: Sequence[int]) -> float:
    """Every file once through the fast path's copying read (gather) into one buffer."""
    reader = ds._reader  # the process's Reader: gather is what fetch and scratch_view use
    sizes = reader.manifest.size
    out = memoryview(BUF)
    started = time.perf_counter()
    for e in entries:
        reader.gather([(e, 0, int(sizes[e]))], out[: int(sizes[e])])
    return time.perf_counter() - started


def drop_page_cache(folder: Path) -> None:
    """The kernel's cached pages of the files in one folder (ours), dropped: a cold read (as
    far as the guest goes: a virtual disk may have the host's cache behind it)."""
    for name in os.listdir(folder):
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def map_against_pread(
    path: str, entries: Sequence[int], cold: bool, rounds: int = 3
) -> dict[str, float] | None:
    """Best seconds of `rounds` to copy every file of a dataset folder, in `entries`' order,
    out of a fresh map and with pread, the two alternating (None: this tree's LocalDataset
    has no pread). `cold`: the segments' pages dropped from the page cache before each."""
    from kspeedfs.format import localdata
    from kspeedfs.format.localdata import read_meta
    from kspeedfs.system.local_dataset import LocalDataset

    if not hasattr(LocalDataset, "read_into"):
        return None
    seg_dir = Path(read_meta(Path(path))["disk_dir"]) / "seg"
    out = memoryview(BUF)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for how in ("map", "pread"):
            local = LocalDataset(path)
            pieces = [p for e in entries for p in local.manifest.ranges(e)]
            warm_memory(256 << 20)
            if cold:
                drop_page_cache(seg_dir)
            mapped = getattr(localdata, "MAPPED_SEGMENTS", None)
            if mapped is not None:
                localdata.MAPPED_SEGMENTS = 0  # every copy a pread (none is mapped here)
            started = time.perf_counter()
            for seg, off, n in pieces:
                if how == "map":
                    out[:n] = local.view(seg, off, n)
                else:
                    local.read_into(seg, off, out[:n])
            took = time.perf_counter() - started
            if mapped is not None:
                localdata.MAPPED_SEGMENTS = mapped
            best[how] = min(best.get(how, took), took)
            local.release()
    return best


def show_tiers(node: NodeProcess) -> None:
    for d in node.request("list")["datasets"]:
        print(
            f"  {d['name']:5s} memory {format_size(d['stored']):>10s}"
            f"  disk {format_size(d['disk_stored']):>10s}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--size", default="64KiB", help="approximate file size")
    p.add_argument("--segment-size", default="16MiB")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench", help="where the data set is kept")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    per_class = max(1, args.files // args.classes)
    kept = ensure_sample(
        Path(args.cache) / f"tier-{args.classes}x{per_class}-{args.size}",
        args.classes,
        per_class,
        args.size,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-tier-"))
    source = workdir / "src"
    shutil.copytree(kept, source)  # a copy: moved away after the first epoch
    files = list_files(source)
    n, data_bytes = len(files), sum(s for _, s in files)
    print(f"data set: {n} files, {format_size(data_bytes)}, {kept}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")

    token = workdir / "token"
    from kspeedfs.format import auth

    auth.write_token(token, auth.new_admin_token())
    # Memory for one copy and less than a segment more: nothing of the disk side moves to
    # memory (promotion) while it is measured.
    memory = data_bytes + data_bytes // 50 + (4 << 20)
    node = NodeProcess(
        Path("/dev/shm") / f"kspeedfs-bench-{os.urandom(5).hex()}",
        token,
        workdir,
        memory=str(memory),
        segment_size=args.segment_size,
        extra=("--spill-dir", str(workdir / "disk"), "--spill", str(2 * data_bytes + (64 << 20))),
    ).start()
    mount: MountProcess | None = None
    try:
        env = node.env()
        for name, tier in (("mem", "memory"), ("disk", "disk")):
            done = subprocess.run(
                [*KSPEEDFS, "preload", str(source), "--name", name, "--tier", tier, "-q"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise SystemExit(done.stderr)
        show_tiers(node)
        mount = MountProcess(workdir / "mnt", env, workdir).start()
        kw = {"nodes": node.address, "token": str(token)}
        sides = {name: KSpeedFolder(str(source), objname=name, **kw) for name in ("mem", "disk")}
        rng = random.Random(args.seed)
        rates: dict[tuple[str, str], list[float]] = {}

        def timed(key: tuple[str, str], run: Callable[[], float]) -> None:
            warm_memory(256 << 20)
            rates.setdefault(key, []).append(n / run())

        for epoch in range(args.epochs):
            shuffled = list(files)
            rng.shuffle(shuffled)
            for name, ds in sides.items():
                index = {rel: i for i, rel in enumerate(ds.files)}
                order = [index[os.fsdecode(rel)] for rel, _ in shuffled]
                timed((name, "fast path"), lambda ds=ds, order=order: read_fast(ds, order))
                entries = [ds._index.entry(i) for i in order]
                timed((name, "fast copy"), lambda ds=ds, e=entries: read_copied(ds, e))
                served = mount.mountpoint / name
                timed(
                    (name, "mount"),
                    lambda served=served, order=shuffled: read_files(served, order)[0],
                )
            if epoch == 0:
                os.rename(source, workdir / "src-moved-away")
        print(f"files/s per epoch ({args.epochs} epochs; the source moved away after the first):")
        for how in ("fast path", "fast copy", "mount"):
            mem, disk = rates[("mem", how)], rates[("disk", how)]
            best_mem, best_disk = max(mem[1:] or mem), max(disk[1:] or disk)
            print(
                f"  {how:9s} memory {' '.join(f'{r:8.0f}' for r in mem)}"
                f"   disk {' '.join(f'{r:8.0f}' for r in disk)}"
                f"   disk/memory {best_disk / best_mem:5.2f} (target >= {TARGET})"
            )
        listed = {d["name"]: d for d in node.request("list")["datasets"]}
        on_disk = sides["disk"]
        index = {rel: i for i, rel in enumerate(on_disk.files)}
        entries = [on_disk._index.entry(index[os.fsdecode(rel)]) for rel, _ in shuffled]
        for cold in (False, True):
            both = map_against_pread(listed["disk"]["path"], entries, cold)
            if both is not None:
                print(
                    f"  disk tier copied, fresh instance, {'cold' if cold else 'warm'} page cache"
                    f" (best of 3): map {n / both['map']:8.0f} files/s"
                    f"   pread {n / both['pread']:8.0f} files/s"
                    f"   pread/map {both['map'] / both['pread']:5.2f}"
                )
        show_tiers(node)  # the same as before: the disk side stayed on disk
        cache = node.request("status")["cache"]
        print(
            f"source bytes after the first epoch: 0 (epochs 2..{args.epochs} read every file with"
            f" the source gone; node read-through fills from sources: {cache.get('fills', 0)})"
        )
    finally:
        if mount is not None:
            mount.stop()
        node.stop()
        remove_tree(node.shm_dir)
        remove_tree(workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
