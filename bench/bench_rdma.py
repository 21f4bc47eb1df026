"""RDMA vs TCP benchmark: bulk reads and batched ~110 KB reads from a node process.

    .venv/bin/python bench/bench_rdma.py [--bulk 512MiB] [--files 2000] [--batch 64]

Starts a private node (its own port, shm folder and token), preloads a generated dataset of a
few large files and many ~110 KB ones, and reads it back through the transports: TCP always,
RDMA where this machine has a usable device (the node then has one too: same machine). Every
transport's bytes are checked against the source once before anything is timed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.client.transport import open_transport
from kspeedfs.format.config import Settings
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.net.transport import Range, TcpTransport, Transport
from kspeedfs.rdma.verbs import probe
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.testing.cache import LocalCache
from kspeedfs.testing.node import remove_tree

BULK_FILE = 128 << 20
BULK_CALL = 64 << 20  # bytes per read_into for bulk reads (the TCP frame limit is 128 MiB)
SMALL_MEAN = 110 * 1024


def make_dataset(root: Path, bulk: int, files: int, seed: int) -> Path:
    """bulk/ (files of up to 128 MiB) and small/ (files of 80-140 KB), made once."""
    stamp = root / f"made-{bulk}-{files}-{seed}"
    src = root / "src"
    if stamp.exists():
        return src
    import random

    remove_tree(root)
    (src / "bulk").mkdir(parents=True)
    (src / "small").mkdir(parents=True)
    rand = random.Random(seed)
    left, k = bulk, 0
    while left > 0:
        n = min(BULK_FILE, left)
        (src / "bulk" / f"{k:03d}.bin").write_bytes(os.urandom(n))
        left -= n
        k += 1
    for i in range(files):
        n = rand.randint(80 * 1024, 140 * 1024)
        (src / "small" / f"{i:06d}.jpg").write_bytes(os.urandom(n))
    stamp.write_text("")
    return src


def file_ranges(ds: LocalDataset, folder: str) -> list[tuple[bytes, list[Range]]]:
    m = ds.manifest
    prefix = folder.encode() + b"/"
    return [(m.path(i), m.ranges(i)) for i in m.iter_files() if m.path(i).startswith(prefix)]


def bulk_calls(files: list[tuple[bytes, list[Range]]]) -> list[list[Range]]:
    """Every bulk file as calls of up to BULK_CALL bytes."""
    calls: list[list[Range]] = []
    for _, ranges in files:
        call: list[Range] = []
        size = 0
        for seg, off, n in ranges:
            while n:
                take = min(n, BULK_CALL - size)
                call.append((seg, off, take))
                size += take
                off += take
                n -= take
                if size == BULK_CALL:
                    calls.append(call)
                    call, size = [], 0
        if call:
            calls.append(call)
    return calls


def timed(fn: Callable[[], int], rounds: int) -> tuple[float, int]:
    """Best seconds of `rounds` runs of fn, and what it returned (bytes)."""
    best = float("inf")
    nbytes = 0
    for _ in range(rounds):
        started = time.perf_counter()
        nbytes = fn()
        best = min(best, time.perf_counter() - started)
    return best, nbytes


def run_calls(
    t: Transport, dataset: tuple[str, str], calls: list[list[Range]], buf: bytearray
) -> int:
    total = 0
    view = memoryview(buf)
    for ranges in calls:
        n = sum(r[2] for r in ranges)
        t.read_into(*dataset, ranges, view[:n])
        total += n
    return total


def check(
    t: Transport, dataset: tuple[str, str], src: Path, files: list[tuple[bytes, list[Range]]]
) -> None:
    for path, ranges in files:
        out = bytearray(sum(r[2] for r in ranges))
        t.read_into(*dataset, ranges, memoryview(out))
        if out != (src / os.fsdecode(path)).read_bytes():
            raise SystemExit(f"{t.name}: wrong bytes for {os.fsdecode(path)}")


def measure(
    t: Transport,
    dataset: tuple[str, str],
    bulk: list[list[Range]],
    small: list[tuple[bytes, list[Range]]],
    batch: int,
    rounds: int,
) -> dict[str, float]:
    buf = bytearray(max(BULK_CALL, batch * 160 * 1024))
    t_bulk, n_bulk = timed(lambda: run_calls(t, dataset, bulk, buf), rounds)
    batches = [
        [r for _, ranges in small[i : i + batch] for r in ranges]
        for i in range(0, len(small), batch)
    ]
    t_batch, n_small = timed(lambda: run_calls(t, dataset, batches, buf), rounds)
    singles = [ranges for _, ranges in small]
    t_single, _ = timed(lambda: run_calls(t, dataset, singles, buf), rounds)
    return {
        "bulk_gbps": n_bulk / t_bulk / 1e9,
        "batched_fps": len(small) / t_batch,
        "batched_mbps": n_small / t_batch / 1e6,
        "single_fps": len(small) / t_single,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bulk", default="512MiB", help="bytes in large files (default 512MiB)")
    p.add_argument("--files", type=int, default=2000, help="~110 KB files (default 2000)")
    p.add_argument("--batch", type=int, default=64, help="small files per read (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each read; the best is kept")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench-rdma", help="dataset folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    src = make_dataset(Path(args.cache), parse_size(args.bulk), args.files, args.seed)
    found = probe()
    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-rdma-"))
    data_bytes = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    with LocalCache(workdir, data_bytes + data_bytes // 10 + (64 << 20)) as node:
        node.preload(src, "rdmabench", show_progress=False)
        ds = LocalDataset(node.shm_dir / "datasets" / "rdmabench")
        bulk_files = file_ranges(ds, "bulk")
        small = file_ranges(ds, "small")
        bulk = bulk_calls(bulk_files)
        small_bytes = sum(r[2] for _, rs in small for r in rs)
        print(
            f"dataset: {format_size(sum(r[2] for c in bulk for r in c))} in "
            f"{len(bulk_files)} large files, {len(small)} small files of mean "
            f"{format_size(small_bytes / max(len(small), 1))}; node {node.address}"
        )
        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
            f"best of {args.rounds} runs each"
        )
        transports: dict[str, Transport] = {"tcp": TcpTransport(node.address, node.settings)}
        if found.usable:
            forced = Settings(**{**vars(node.settings), "transport": "rdma"})
            transports["rdma"] = open_transport(node.address, forced)
            print(f"RDMA device: {found.device} port {found.port}")
        else:
            print(f"RDMA not measured, TCP figures only: {found.reason}")
        results = {}
        for name, t in transports.items():
            instance = ("rdmabench", ds.uuid)  # (name, instance id): what every read names
            check(t, instance, src, bulk_files[:1] + small[:200])
            results[name] = measure(t, instance, bulk, small, args.batch, args.rounds)
            t.close()

    print(f"\n{'':28}" + "".join(f"{name:>14}" for name in results))
    rows = [
        ("bulk read (GB/s)", "bulk_gbps", "{:14.2f}"),
        (f"batched, {args.batch}/read (files/s)", "batched_fps", "{:14.0f}"),
        (f"batched, {args.batch}/read (MB/s)", "batched_mbps", "{:14.1f}"),
        ("one at a time (files/s)", "single_fps", "{:14.0f}"),
    ]
    for label, key, fmt in rows:
        print(f"{label:28}" + "".join(fmt.format(r[key]) for r in results.values()))
    if "rdma" in results:
        print("\nRDMA / TCP:")
        for label, key, _ in rows:
            print(f"  {label:28} {results['rdma'][key] / results['tcp'][key]:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
