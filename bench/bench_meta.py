"""Meta-file benchmark: the node's mapped meta index against a meta file parsed into a list.

    .venv/bin/python bench/bench_meta.py [--lines 1000000,10000000] [--workers 8]

For each size, a meta file of that many lines naming a few small files (the index is what is
measured, not the files) is preloaded with `--meta` into a private node, then it prints, side
by side for KSpeedMetaDataset and a list-based Dataset on the same file:
  (1) index build rate (lines/s, what the node does once) beside parsing the file into a list;
  (2) dataset construction time in a job process;
  (3) memory per DataLoader worker (USS growth after random samples, `--workers` workers);
  (4) random __getitem__ rate on the meta alone (entry and target; no file is read).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from kspeedfs.client import admin  # noqa: E402
from kspeedfs.format import metaindex  # noqa: E402
from kspeedfs.sample import make_sample  # noqa: E402
from kspeedfs.system.local_dataset import LocalDataset  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import KSpeedMetaDataset  # noqa: E402

MiB = 1 << 20
SAMPLES_PER_WORKER = 20000


class ListMeta(Dataset[tuple[str, int]]):
    """The usual meta dataset: every line parsed into a list of (path, target)."""

    def __init__(self, meta: Path):
        self.samples: list[tuple[str, int]] = []
        with open(meta) as f:
            for line in f:
                path, target = line.split()
                self.samples.append((path, int(target)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[str, int]:
        return self.samples[i]


class MetaOnly(Dataset[tuple[int, Any]]):
    """KSpeedMetaDataset's sample list alone: (manifest entry, target), no file read."""

    def __init__(self, ds: KSpeedMetaDataset):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return self.ds._index.entry(i), self.ds._index.target(i)


def write_meta(root: Path, lines: int) -> Path:
    meta = root / f"train-{lines}.txt"
    if meta.exists():
        return meta
    if not (root / "img").exists():
        make_sample(root / "img", classes=4, per_class=4, file_size=2000, bases=2)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.JPEG"))
    picks = np.random.default_rng(0).integers(0, len(files), lines).tolist()
    tmp = meta.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for start in range(0, lines, 1 << 20):
            chunk = picks[start : start + (1 << 20)]
            f.writelines(f"{files[k]} {(start + i) % 1000}\n" for i, k in enumerate(chunk))
    tmp.rename(meta)
    return meta


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def worker_growth(ds: Dataset[Any], indices: list[int], workers: int) -> list[float]:
    """USS growth of each DataLoader worker (MiB) after its share of `indices`."""
    ctx = multiprocessing.get_context("fork")
    started = ctx.Array("q", workers)
    pids = ctx.Array("q", workers)

    def at_start(worker_id: int) -> None:
        me = psutil.Process()
        pids[worker_id] = me.pid
        started[worker_id] = me.memory_full_info().uss

    loader = DataLoader(
        ds,
        batch_size=500,
        sampler=indices,
        num_workers=workers,
        worker_init_fn=at_start,
        persistent_workers=True,
        multiprocessing_context=ctx,
    )
    for _batch in loader:
        pass
    out = [
        (psutil.Process(pids[w]).memory_full_info().uss - started[w]) / MiB for w in range(workers)
    ]
    del loader
    return out


def getitem_rate(get: Callable[[int], Any], n: int, count: int = 200_000) -> float:
    picks = [random.randrange(n) for _ in range(count)]
    started = time.perf_counter()
    for i in picks:
        get(i)
    return count / (time.perf_counter() - started)


def run(cache: LocalCache, data: Path, lines: int, workers: int) -> None:
    meta = write_meta(data, lines)
    name = f"meta{lines}"
    print(f"\n== {lines:,} lines ({meta.stat().st_size / MiB:.0f} MiB meta file)")
    _, preload_s = timed(
        lambda: admin.preload(
            cache.settings, str(data), name, show_progress=False, meta=[meta.name]
        )
    )
    # (1) what the node did, again in this process: parse and resolve every line, write.
    path = Path(cache.request("list")["datasets"][0]["path"])
    manifest = LocalDataset(path).manifest
    raw = meta.read_bytes()
    out = Path(tempfile.mkdtemp()) / "x.kmi"
    _, build_s = timed(
        lambda: metaindex.build_index(raw, manifest, out, {"uuid": "x", "meta": meta.name})
    )
    index_mib = out.stat().st_size / MiB
    out.unlink()
    raw = b""  # the list parse below reads the file itself
    listed, list_s = timed(lambda: ListMeta(meta))
    print(
        f"index build     {lines / build_s:12,.0f} lines/s ({build_s:.1f} s, {index_mib:.0f} MiB)"
        f"   list parse {lines / list_s:12,.0f} lines/s ({list_s:.1f} s)"
        f"   ratio {list_s / build_s:.2f}x   (preload with --meta: {preload_s:.1f} s)"
    )
    # (2) construction in a job process
    kw = {"nodes": str(cache.address), "token": str(cache.token_file)}
    ds, ds_s = timed(lambda: KSpeedMetaDataset(data, meta.name, **kw))
    print(
        f"construction    {ds_s:12.3f} s"
        f"                           list {list_s:12.3f} s   ratio {list_s / ds_s:.0f}x"
    )
    # (4) random __getitem__ on the meta alone
    only = MetaOnly(ds)
    kspeed_rate = getitem_rate(only.__getitem__, lines)
    list_rate = getitem_rate(listed.__getitem__, lines)
    print(
        f"random getitem  {kspeed_rate:12,.0f} /s"
        f"                          list {list_rate:12,.0f} /s   ratio {kspeed_rate / list_rate:.2f}x"
    )
    # (3) memory per worker; measured for the index before the list exists in this process
    # (forked workers would inherit the list, and the collector would copy it into them).
    del listed
    indices = random.sample(range(lines), SAMPLES_PER_WORKER * workers)
    kspeed_mem = worker_growth(only, indices, workers)
    listed = ListMeta(meta)
    list_mem = worker_growth(listed, indices, workers)
    print(
        f"worker USS +    {max(kspeed_mem):10.2f} MiB (max of {workers})"
        f"             list {max(list_mem):10.2f} MiB   "
        f"({SAMPLES_PER_WORKER:,} random samples per worker)"
    )
    del listed, ds, only
    cache.request("unload", name=name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", default="1000000,10000000", help="meta sizes, comma-separated")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers for memory")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench-meta", help="generated files")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    random.seed(0)
    data = Path(args.cache) / "data"
    data.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.lines.split(",")]
    for lines in sizes:
        write_meta(data, lines)
    budget = sum((data / f"train-{n}.txt").stat().st_size for n in sizes) * 4 + (256 << 20)
    with LocalCache(Path(args.cache) / "node", budget) as cache:
        for lines in sizes:
            run(cache, data, lines, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
