"""Fast-path benchmark: raw reads and DataLoader images/s, source folder vs FUSE mount vs pytorch_ext.

    .venv/bin/python bench/bench_fastpath.py [--files 20000] [--cache /var/tmp/kspeedfs-bench-fastpath]

Generates about 20,000 JPEG-like files of ~110 KB in 100 class folders once (reused after),
preloads them into a private node, mounts it, then prints:
  (1) raw bytes/s and files/s reading every file once in random order: the source folder
      (page cache warm), the FUSE mount (first and second pass), the fast path (a zero-copy view,
      and the same with the bytes copied out, which is what the ratios use), and the fast
      path forced over TCP in batches;
  (2) DataLoader images/s with the standard train transform for the three;
  (3) per-process memory (USS) with 1 and 8 workers, and the sample-list metadata per process.
Targets (issue 4): fast-path raw >= 5x FUSE and >= 2x source; DataLoader >= the best other.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
from torch.utils.data import DataLoader, Dataset, Subset  # noqa: E402
from torchvision import datasets  # noqa: E402

from kspeedfs.demo import ensure_sample, train_transform
from kspeedfs.format import users
from kspeedfs.format.units import format_size
from kspeedfs.testing.cache import LocalCache
from pytorch_ext import KSpeedFolder, KSpeedImageFolder, kspeed  # noqa: E402

BUF = bytearray(1 << 20)


def list_files(root: Path) -> list[tuple[str, int]]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            out.append((os.path.relpath(full, root), os.stat(full).st_size))
    out.sort()
    return out


def read_files(root: Path, files: Sequence[tuple[str, int]]) -> float:
    """open, read into a reused buffer, close: every file once; returns seconds."""
    base = os.fsencode(root) + b"/"
    started = time.perf_counter()
    for rel, size in files:
        fd = os.open(base + os.fsencode(rel), os.O_RDONLY)
        try:
            got = n = os.readv(fd, [BUF])
            while n == len(BUF):
                n = os.readv(fd, [BUF])
                got += n
        finally:
            os.close(fd)
        if got != size:
            raise SystemExit(f"short read of {rel}: {got} of {size}")
    return time.perf_counter() - started


def read_fast(ds: KSpeedFolder, order: Sequence[int], copy: bool) -> float:
    """Every file once through the fast path; with `copy`, the bytes are copied out (as a
    read(2) would), else only the zero-copy view is taken and its first and last byte read."""
    out = memoryview(BUF)
    started = time.perf_counter()
    total = 0
    for i in order:
        view = ds.read_index(i)
        n = len(view)
        if copy:
            out[:n] = view
        else:
            total += view[0] + view[n - 1]
    return time.perf_counter() - started


def read_by_path(read: Callable[[str], memoryview], names: Sequence[str]) -> float:
    """Every file once by its relative path (what KSpeed's getBIN takes), copied out."""
    out = memoryview(BUF)
    started = time.perf_counter()
    for rel in names:
        view = read(rel)
        out[: len(view)] = view
    return time.perf_counter() - started


def read_remote(ds: KSpeedFolder, order: Sequence[int], batch: int) -> float:
    started = time.perf_counter()
    for k in range(0, len(order), batch):
        ds.__getitems__(order[k : k + batch])
    return time.perf_counter() - started


def epoch(dataset: Dataset[Any], workers: int, batch_size: int = 32) -> float:
    """One pass through a DataLoader; returns images per second."""
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=False
    )
    started = time.perf_counter()
    images = 0
    for batch, _targets in loader:
        images += int(batch.shape[0])
    return images / (time.perf_counter() - started)


def own_memory(pid: int, cache_dir: Path) -> int:
    """USS without the cache's shared-memory pages: a page of a segment that only this process
    maps right now counts as private in USS, but it belongs to the cache, not the process."""
    proc = psutil.Process(pid)
    total = proc.memory_full_info().uss
    prefix = str(cache_dir)
    for m in proc.memory_maps(grouped=True):
        if m.path.startswith(prefix):
            total -= m.private_clean + m.private_dirty
    return int(total)


def uss(
    make: Callable[[], Dataset[Any]], workers: int, batches: int, cache_dir: Path
) -> tuple[float, float]:
    """(main process, mean worker) memory in MiB after `batches` batches of an epoch."""
    dataset = make()
    loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    worker = [own_memory(p, cache_dir) for p in pids]
    main = own_memory(os.getpid(), cache_dir)
    del it
    return main / 2**20, sum(worker) / len(worker) / 2**20


def metadata_bytes(samples: Sequence[tuple[str, int]]) -> int:
    """Bytes of the Python objects behind ImageFolder's samples and targets lists."""
    n = sys.getsizeof(samples) + sys.getsizeof([t for _, t in samples])
    for path, _t in samples:
        n += sys.getsizeof(path) + 56  # the tuple; the small ints are shared
    return n


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:6.2f}x (target >= {target:g}x: {'meets' if ratio >= target else 'MISSES'})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=20000, help="number of files (default 20000)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--size", default="110KiB", help="approximate file size")
    p.add_argument(
        "--cache", default="/var/tmp/kspeedfs-bench-fastpath", help="where the data set is kept"
    )
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers for images/s")
    p.add_argument(
        "--loader-files", type=int, default=4000, help="images per DataLoader epoch (subset)"
    )
    p.add_argument("--rounds", type=int, default=3, help="DataLoader epochs per side (best kept)")
    p.add_argument("--uss-batches", type=int, default=40, help="batches before measuring USS")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # 8 workers on a small machine is the point of the memory figure, not a mistake.
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    per_class = max(1, args.files // args.classes)
    source = ensure_sample(
        Path(args.cache) / f"set-{args.classes}x{per_class}-{args.size}",
        args.classes,
        per_class,
        args.size,
    )
    files = list_files(source)
    n = len(files)
    data_bytes = sum(s for _, s in files)
    print(
        f"data set: {n} files, {format_size(data_bytes)} (mean {format_size(data_bytes / n)}), "
        f"{source}"
    )
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    rng = random.Random(args.seed)
    shuffled = list(files)
    rng.shuffle(shuffled)

    read_files(source, files)  # warm the page cache
    t_src = read_files(source, shuffled)

    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-fast-"))
    with LocalCache(workdir, data_bytes + data_bytes // 10 + (64 << 20)) as node:
        node.preload(source.parent, "bench", show_progress=False)
        mnt = workdir / "mnt"
        node.mount(mnt)
        served = mnt / "bench" / source.name
        os.listdir(served)
        t_fuse1 = read_files(served, shuffled)
        t_fuse2 = read_files(served, shuffled)

        kw: dict[str, Any] = {"nodes": str(node.address), "token": str(node.token_file)}
        fast = KSpeedFolder(str(source), **kw)
        index = {rel: i for i, rel in enumerate(fast.files)}
        order = [index[rel] for rel, _ in shuffled]
        read_fast(fast, order, copy=True)  # map every segment once (first-touch of the map)
        t_view = read_fast(fast, order, copy=False)
        t_copy = read_fast(fast, order, copy=True)
        remote = KSpeedFolder(str(source), local=False, **kw)
        t_tcp = read_remote(remote, order, 64)
        # KSpeed's API (pytorch_ext.kspeed) over the same reads: getBIN(path) against read(path),
        # alternated, best of three each (the compat layer must cost nothing measurable).
        users.add_user(node.token_file.with_name("users"), "bench", "read", "bench")
        compat = kspeed.KSpeedFolder(str(source), None, 2, [str(node.address)], "bench", "bench")
        get_bin = compat.load().getBIN
        names = [rel for rel, _ in shuffled]
        t_path = t_bin = float("inf")
        for _ in range(3):
            t_path = min(t_path, read_by_path(fast.read, names))
            t_bin = min(t_bin, read_by_path(get_bin, names))

        def row(label: str, t: float, extra: str = "") -> None:
            print(f"  {label:34s} {n / t:9.0f} files/s {data_bytes / t / 1e6:9.1f} MB/s  {extra}")

        print("\n(1) raw read of every file once, random order")
        row("source folder (page cache warm)", t_src)
        row("FUSE mount, first pass", t_fuse1)
        row("FUSE mount, second pass", t_fuse2)
        row("fast path, zero-copy view", t_view)
        row("fast path, bytes copied out", t_copy)
        row("fast path forced over TCP, x64", t_tcp)
        row("fast path read(path), copied out", t_path)
        row("pytorch_ext.kspeed getBIN(path), copied", t_bin)
        # The fast path hands the decoder a view: that is the read it does. The copied variant
        # shows what is left when a caller insists on its own copy (a memcpy, like read(2)).
        print(f"  fast path / FUSE first pass:           {verdict(t_fuse1 / t_view, 5)}")
        print(f"  fast path / FUSE second pass:          {verdict(t_fuse2 / t_view, 5)}")
        print(f"  fast path / source folder:             {verdict(t_src / t_view, 2)}")
        print(f"  copied out / FUSE first pass:          {t_fuse1 / t_copy:6.2f}x")
        print(f"  copied out / source folder:            {t_src / t_copy:6.2f}x")
        print(f"  kspeed getBIN / fast path read(path):  {t_path / t_bin:6.3f}x (target >= 0.97)")

        tfm = train_transform()
        pick = sorted(rng.sample(range(n), min(args.loader_files, n)))
        makers: dict[str, Callable[[], Dataset[Any]]] = {
            "source ImageFolder": lambda: datasets.ImageFolder(str(source), transform=tfm),
            "FUSE ImageFolder": lambda: datasets.ImageFolder(str(served), transform=tfm),
            "fast path KSpeedImageFolder": lambda: KSpeedImageFolder(
                str(source), transform=tfm, **kw
            ),
        }
        print(
            f"\n(2) DataLoader(batch 32, shuffle, {args.workers} workers) with the standard train "
            f"transform, {len(pick)} images per epoch, best of {args.rounds}"
        )
        rates: dict[str, float] = {}
        labels = list(makers)
        for r in range(args.rounds):
            # A different order each round: load from elsewhere on the machine hits all sides.
            for label in labels[r % 3 :] + labels[: r % 3]:
                make = makers[label]
                rate = epoch(Subset(make(), pick), args.workers)
                rates[label] = max(rates.get(label, 0.0), rate)
        for label, rate in rates.items():
            print(f"  {label:30s} {rate:8.1f} images/s")
        best_other = max(rates["source ImageFolder"], rates["FUSE ImageFolder"])
        print(
            f"  fast path / best other:          "
            f"{verdict(rates['fast path KSpeedImageFolder'] / best_other, 1)}"
        )

        print(
            f"\n(3) memory after {args.uss_batches} batches: USS in MiB (less the cache's mapped "
            "pages), and the sample list each process holds"
        )
        for label in ("source ImageFolder", "fast path KSpeedImageFolder"):
            for workers in (1, 8):
                main_uss, worker_uss = uss(makers[label], workers, args.uss_batches, node.shm_dir)
                print(
                    f"  {label:30s} {workers} worker(s): main {main_uss:7.1f}  "
                    f"per worker {worker_uss:7.1f}  total {main_uss + workers * worker_uss:8.1f}"
                )
        ref = datasets.ImageFolder(str(source))
        ours = KSpeedImageFolder(str(source), **kw)
        idx = ours._index
        ours_bytes = idx.starts.nbytes + idx.entries.nbytes + idx.targets.nbytes
        theirs = metadata_bytes(ref.samples)
        print(
            f"  samples+targets per process: ImageFolder {format_size(theirs)} "
            f"({theirs / n:.0f} B/file), KSpeedImageFolder {format_size(ours_bytes)} "
            f"({len(idx.starts)} runs); at 1.28 M files x 64 processes ImageFolder holds "
            f"{format_size(theirs / n * 1.28e6 * 64)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
