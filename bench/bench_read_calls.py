"""Per-call cost of the fast path's reads of a local dataset, in µs per 64 KiB file: `gather`
(the copying read: fetch, scratch_view), the zero-copy view (`read_index`), and LocalDataset's
own copy of a file (read_file_into; a tree without it: read_into per piece), memory tier and
disk tier, in one process. Issue 28's supporting figure where bench_disk_tier.py is noisy.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_read_calls.py [--unsealed] [--rounds 5]

One node with a memory tier and a disk tier (`spill_dir`), as bench_disk_tier.py sets it up;
each figure is the best and the median of `rounds` passes over every file in a shuffled order,
after a first pass (the disk tier's files checked). `--unsealed`: the node runs without
CAP_LINUX_IMMUTABLE (its segments are not sealed: disk-tier copies are preads). Runs on the
/work/base tree too (PYTHONPATH=/work/base), which has no sealing (--unsealed is refused).
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fuse import list_files  # noqa: E402

from kspeedfs.demo import ensure_sample  # noqa: E402
from kspeedfs.format import auth  # noqa: E402
from kspeedfs.system.local_dataset import LocalDataset  # noqa: E402
from kspeedfs.testing import node as testing_node  # noqa: E402
from kspeedfs.testing.node import NodeProcess  # noqa: E402
from kspeedfs.testing.process import KSPEEDFS  # noqa: E402
from pytorch_ext import KSpeedFolder  # noqa: E402

BUF = memoryview(bytearray(64 << 20))


def remove(path: Path) -> None:
    """A node folder removed (its segments may be sealed, where this tree seals them)."""
    remove_tree = getattr(testing_node, "remove_tree", None)
    if remove_tree is not None:
        remove_tree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def per_call(run: Callable[[], int], rounds: int) -> tuple[float, float]:
    """(best, median) µs per call of `rounds` passes, after one untimed pass."""
    run()
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        calls = run()
        took.append((time.perf_counter() - started) / calls * 1e6)
    took.sort()
    return took[0], took[len(took) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--size", default="64KiB", help="approximate file size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--unsealed", action="store_true", help="a node that cannot seal segments")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench", help="where the data set is kept")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    wrapper: tuple[str, ...] = ()
    if args.unsealed:
        if not hasattr(testing_node, "NO_IMMUTABLE"):
            raise SystemExit("this tree does not seal segments: --unsealed means nothing here")
        wrapper = testing_node.NO_IMMUTABLE

    classes = 20
    kept = ensure_sample(
        Path(args.cache) / f"tier-{classes}x{max(1, args.files // classes)}-{args.size}",
        classes,
        max(1, args.files // classes),
        args.size,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-calls-"))
    source = workdir / "src"
    shutil.copytree(kept, source)
    data_bytes = sum(s for _, s in list_files(source))
    token = workdir / "token"
    auth.write_token(token, auth.new_admin_token())
    node = NodeProcess(
        Path("/dev/shm") / f"kspeedfs-bench-{os.urandom(5).hex()}",
        token,
        workdir,
        memory=str(data_bytes + data_bytes // 50 + (4 << 20)),
        segment_size="16MiB",
        extra=("--spill-dir", str(workdir / "disk"), "--spill", str(2 * data_bytes + (64 << 20))),
        **({"wrapper": wrapper} if wrapper else {}),
    ).start()
    try:
        for name, tier in (("mem", "memory"), ("disk", "disk")):
            done = subprocess.run(
                [*KSPEEDFS, "preload", str(source), "--name", name, "--tier", tier, "-q"],
                env=node.env(),
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise SystemExit(done.stderr)
        listed = {d["name"]: d for d in node.request("list")["datasets"]}
        kw = {"nodes": node.address, "token": str(token)}
        print(f"load average {os.getloadavg()[0]:.2f}; {'un' if args.unsealed else ''}sealed")
        for name in ("mem", "disk"):
            ds = KSpeedFolder(str(source), objname=name, **kw)
            reader = ds._reader
            sizes = [int(s) for s in reader.manifest.size]
            order = list(range(len(ds.files)))
            random.Random(0).shuffle(order)
            entries = [ds._index.entry(i) for i in order]

            def gather(reader=reader, sizes=sizes, entries=entries) -> int:
                for e in entries:
                    reader.gather([(e, 0, sizes[e])], BUF[: sizes[e]])
                return len(entries)

            def view(ds=ds, order=order) -> int:
                for i in order:
                    ds.read_index(i)
                return len(order)

            local = LocalDataset(listed[name]["path"])
            into = getattr(local, "read_file_into", None)

            def copy(local=local, into=into, sizes=sizes, entries=entries) -> int:
                for e in entries:
                    if into is not None:
                        into(e, 0, BUF[: sizes[e]])
                    else:
                        for seg, off, n in local.manifest.ranges(e):
                            local.read_into(seg, off, BUF[:n])
                return len(entries)

            for what, run in (("gather", gather), ("view", view), ("local copy", copy)):
                best, median = per_call(run, args.rounds)
                print(f"  {name:4s} {what:10s} µs per file: best {best:6.2f}  median {median:6.2f}")
            local.release()
    finally:
        node.stop()
        remove(node.shm_dir)
        remove(workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
