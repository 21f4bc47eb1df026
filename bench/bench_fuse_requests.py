"""Per-request CPU of the mount's serving path: LOOKUP and READ as one worker handles them.

    .venv/bin/python bench/bench_fuse_requests.py [--files 4000] [--profile]

Preloads a generated tree on a private node, builds the filesystem and request loop a mount
worker runs (the same classes, the node's real mapped dataset), and feeds the loop LOOKUP and
READ requests as the kernel would send them in no-open mode, with replies written to
/dev/null. What it prints is the Python side of each request in microseconds of CPU (the
kernel's part, about 2 readv/writev syscalls, is not in it). `--profile` adds the top
functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.contract.node import DatasetListing
from kspeedfs.fuse import kernel
from kspeedfs.fuse.filesystem import KSpeedFS
from kspeedfs.testing.cache import LocalCache


class NoSupervisor:
    def ask_refresh(self, force: bool, wait: float) -> None:
        pass

    def wait_invalidations(self, timeout: float) -> None:
        pass


def make_tree(root: Path, files: int, size: int) -> None:
    rng = random.Random(0)
    for i in range(files):
        path = root / f"class{i % 100:03d}" / f"img{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))


def request(opcode: int, unique: int, ino: int, body: bytes) -> memoryview:
    header = kernel.IN_HEADER.pack(
        kernel.IN_HEADER.size + len(body), opcode, unique, ino, 0, 0, 0, 0, 0
    )
    return memoryview(header + body)


def cpu_per_call(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    started = time.process_time()
    fn()
    return (time.process_time() - started) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=4000)
    p.add_argument("--size", type=int, default=110 * 1024)
    p.add_argument("--rounds", type=int, default=5, help="passes over every file (best kept)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="kspeedfs-bench-req-") as tmp:
        src = Path(tmp) / "src"
        make_tree(src, args.files, args.size)
        cache = LocalCache(Path(tmp) / "work", args.files * args.size * 2 + (256 << 20))
        with cache:
            cache.preload(src, "ds", show_progress=False)
            reader = ClusterReader(cache.settings, str(cache.address))
            fs = KSpeedFS(reader, NoSupervisor())
            info = DatasetListing.from_wire(cache.request("list")).ready()["ds"]
            fs.add(1, "ds", info.uuid, info, None)
            mounted = fs.by_name["ds"]
            m = mounted.data.manifest
            files = list(m.iter_files())
            parents = [fs._inode(mounted, int(m.parent[i])) for i in files]
            names = [m.name(i) + b"\0" for i in files]
            inodes = [fs._inode(mounted, i) for i in files]
            devnull = os.open("/dev/null", os.O_WRONLY)
            loop = kernel.RequestLoop(fs, devnull, [memoryview(bytearray(8 * kernel.SLOTS))])
            row = loop.rows[0].cast("Q")
            lookups = [
                request(kernel.LOOKUP, k, parent, name)
                for k, (parent, name) in enumerate(zip(parents, names, strict=True))
            ]
            reads = [
                request(kernel.READ, k, ino, kernel.READ_IN.pack(0, 0, 128 * 1024))
                for k, ino in enumerate(inodes)
            ]

            def run(reqs: list[memoryview]) -> None:
                handle = loop._handle
                for r in reqs:
                    handle(r, row)

            print(
                f"{len(files)} files of {args.size} bytes, machine load {os.getloadavg()[0]:.2f},"
                f" best of {args.rounds} passes"
            )
            for label, reqs in (("LOOKUP", lookups), ("READ (local, 128 KiB)", reads)):
                best = min(
                    cpu_per_call(lambda r=reqs: run(r), len(reqs)) for _ in range(args.rounds)
                )
                print(f"  {label:24} {best:6.1f} us CPU per request")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                run(lookups)
                run(reads)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
            reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
