"""Small files at ImageNet's shape: the source folder, the mount and squashfuse_ll side by side.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_small_files.py [--walk-files 1281000]
        [--walk-folders 1000] [--files 2000] [--size 100000] [--no-squashfs] [--no-tar]
        [--poll-us 300] [--uring 3]

One run, one tree, three ways to read it: the source folder (warm page cache), a kspeedfs
mount of a private node, and squashfuse_ll (C, libfuse low-level) over a squashfs image of the
same tree (squashfuse and squashfs-tools are installed from Debian where missing; without root
or apt that column is left out). Printed, with the mount's ratio to each:
- a fresh mount's first `os.walk` of `--walk-files` empty files in `--walk-folders` folders,
  names and sizes (lstat) of every entry, and the kernel's requests per file on the mount
  (memory warmed, and the kernel's FUSE inode caches grown by a walk of a mount thrown away,
  before each side, as for pass 1);
- per-file `open(p, "rb").read()` with Python's default buffering over `--files` files of
  `--size` bytes, second pass (page cache warm everywhere), and the requests it costs;
- passes 1 (fresh mount) and 2 with `os.open`/`os.read`, the same files;
- `fuse_poll_us` (`--poll-us`, off by default) against 0 on fresh mounts, alternating: the
  buffered pass, and two processes that compute between their files (DataLoader workers'
  shape), to show what polling gives and costs on this machine;
- `fuse_uring` (`--uring ROUNDS`, off by default) against the classic transport: the buffered
  pass on fresh mounts, the two alternating (order reversed every other round), each round
  beside the source's figure of that moment, and the two computing readers; every figure printed (enable_uring, which the
  mount sets to Y as root, is put back as it was);
- ImageFolder (stock torchvision, raw bytes loader) over the mount's tar view `ds@tar/` of tars
  of those files, against the same over the extracted tree on the same mount (`--no-tar`
  leaves it out; needs torchvision);
- pass 1 as a training job reads (buffered `open().read()`, which asks isatty: LOOKUP, IOCTL
  and READ per file) on a fresh mount against a fresh squashfuse_ll, with µs per file and the
  mount's requests per file;
- the merged tar view `ds@untar/` (`--members N`, 0 leaves it out; `--only-untar` runs it
  alone, on a node of its own): N members of `--member-size` bytes in `--untar-shards` tars,
  each class folder spread over every shard, beside their extraction: the time a fresh mount
  takes to list the view (its table built from the tars' headers), the memory each serving
  process holds for it, and a stock ImageFolder epoch (`--epoch-files` samples at most, in a
  shuffled order) over the view against the extraction through the same mount and on the
  source.
Run it with PYTHONPATH set to the tree to measure (the bench's own imports follow it), so that
a "before" is the same script over an older tree: sections that tree lacks print "n/a".
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


try:
    from kspeedfs.testing.bench import halt_polling
except ImportError:  # an older tree measured as the "before"

    def halt_polling() -> str:
        return "guest halt polling: n/a"


from kspeedfs.testing.bench import warm_memory
from kspeedfs.testing.cache import LocalCache

STATS_XATTR = "user.kspeedfs.stats"
TARGETS = {"walk": 0.3, "buffered": 0.35, "squash": 1.5, "tar_imagefolder": 0.9}
COMPUTE_REPEAT = 20  # the CRC runs over the file this many times
WALK_BYTES_PER_ENTRY = 2048  # a FUSE inode and its dentry, with room
DEBIAN = {"squashfuse_ll": "squashfuse", "mksquashfs": "squashfs-tools"}


def make_walk_tree(root: Path, files: int, folders: int) -> None:
    per = max(1, files // folders)
    for d in range(folders):
        folder = root / f"n{d:08d}"
        folder.mkdir(parents=True)
        for i in range(per):
            (folder / f"n{d:08d}_{i}.JPEG").touch()


def make_read_tree(root: Path, files: int, size: int, classes: int = 20) -> None:
    rng = random.Random(0)
    for i in range(files):
        path = root / f"class{i % classes:02d}" / f"img{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))


def make_tars(tree: Path, out: Path, shards: int) -> None:
    """The read tree packed into `shards` tars (member paths `classNN/imgNNNNNN.jpg`)."""
    files = sorted(p for p in tree.rglob("*") if p.is_file())
    out.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(out / f"shard-{s:04d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for p in files[s::shards]:
                tar.add(p, arcname=str(p.relative_to(tree)))


def walk(root: Path) -> tuple[float, int]:
    """os.walk with an lstat of every entry (what `find -ls` or a file list does)."""
    started = time.perf_counter()
    n = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return time.perf_counter() - started, n


def buffered_reads(paths: list[str]) -> float:
    started = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            f.read()
    return time.perf_counter() - started


def os_reads(paths: list[str]) -> float:
    started = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - started


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        pass


def stats(mount: Path) -> dict[str, int]:
    try:
        raw = os.getxattr(mount, STATS_XATTR)
    except OSError:
        return {}
    return {k: v for k, v in json.loads(raw).items() if isinstance(v, int) and v}


def per_file(before: dict[str, int], after: dict[str, int], files: int) -> str:
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    shown = {k: v / files for k, v in diff.items() if v > 0}
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(shown.items())) or "none"


def ensure_squashfs() -> bool:
    missing = [pkg for tool, pkg in DEBIAN.items() if shutil.which(tool) is None]
    if missing:
        print(f"installing {' '.join(missing)} from Debian ...", flush=True)
        subprocess.run(["apt-get", "install", "-y", *missing], capture_output=True)
    return all(shutil.which(tool) for tool in DEBIAN)


class Squash:
    """squashfuse_ll over a squashfs image of `tree`, mounted (again) at `mountpoint`."""

    def __init__(self, tree: Path, image: Path, mountpoint: Path):
        self.image = image
        self.mountpoint = mountpoint
        subprocess.run(
            ["mksquashfs", str(tree), str(image), "-noappend", "-quiet", "-no-progress"],
            check=True,
            capture_output=True,
        )
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def mount(self) -> None:
        self.unmount()
        self.proc = subprocess.Popen(["squashfuse_ll", "-f", str(self.image), str(self.mountpoint)])
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mountpoint):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("squashfuse_ll did not mount")
            time.sleep(0.02)

    def unmount(self) -> None:
        """Unmount and wait for squashfuse_ll to exit: on a loaded machine that can take more
        than 10 s after a lazy unmount; it is ended after 60 s."""
        if self.proc is not None:
            done = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
            if done.returncode:
                subprocess.run(
                    ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True
                )
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(10)
            self.proc = None


def row(label: str, values: list[float | None], unit: str) -> None:
    cells = [f"{v:>12,.0f}" if v is not None else f"{'n/a':>12}" for v in values]
    print(f"  {label:<34}{''.join(cells)}  {unit}")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "n/a"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--walk-files", type=int, default=1_281_000)
    p.add_argument("--walk-folders", type=int, default=1000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--no-squashfs", action="store_true")
    p.add_argument("--no-tar", action="store_true")
    p.add_argument(
        "--poll-us",
        type=int,
        default=300,
        help="fuse_poll_us measured against 0 on the same files (0: leave that out)",
    )
    p.add_argument(
        "--uring",
        type=int,
        default=0,
        help="rounds of the buffered pass with fuse_uring against without (0: leave that out)",
    )
    p.add_argument("--repeat", type=int, default=3, help="warm passes timed (best kept)")
    p.add_argument("--tmp", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--members", type=int, default=0, help="members of the merged view's tars")
    p.add_argument("--untar-shards", type=int, default=1024, help="tars they are spread over")
    p.add_argument("--member-size", type=int, default=100, help="bytes of each member")
    p.add_argument("--classes", type=int, default=1000, help="class folders of the members")
    p.add_argument("--epoch-files", type=int, default=50_000, help="samples an epoch reads")
    p.add_argument("--only-untar", action="store_true", help="the merged view alone")
    args = p.parse_args()
    if args.only_untar:
        return untar_bench(args)

    squash_ok = not args.no_squashfs and ensure_squashfs()
    with tempfile.TemporaryDirectory(prefix="kspeedfs-bench-small-", dir=args.tmp) as tmp_:
        tmp = Path(tmp_)
        src = tmp / "src"
        print(f"making {args.walk_files:,} empty files in {args.walk_folders} folders ...")
        make_walk_tree(src / "walk", args.walk_files, args.walk_folders)
        make_read_tree(src / "read", args.files, args.size)
        tars = not args.no_tar
        if tars:
            make_tars(src / "read", src / "tars", args.shards)
        walk_files = (args.walk_files // args.walk_folders) * args.walk_folders
        total = walk_files * 1024 + args.files * args.size * 3 + (512 << 20)
        cache = LocalCache(tmp / "work", total)
        squash = Squash(src, tmp / "tree.sqfs", tmp / "sq") if squash_ok else None
        mnt = tmp / "mnt"
        mroot = mnt / "ds"
        with cache:
            started = time.perf_counter()
            cache.preload(src, "ds", show_progress=False)
            print(f"preloaded in {time.perf_counter() - started:.1f}s")
            read_rel = sorted(
                str(p.relative_to(src)) for p in (src / "read").rglob("*") if p.is_file()
            )
            random.Random(1).shuffle(read_rel)
            results: dict[str, list[float | None]] = {}

            def three(
                name: str, fn: Callable[[Path], float | None], fresh: bool = False
            ) -> list[float | None]:
                out: list[float | None] = [fn(src)]
                if fresh:
                    cache.unmount(mnt)
                    cache.mount(mnt)
                out.append(fn(mroot))
                if squash is not None:
                    if fresh:
                        squash.mount()
                    out.append(fn(squash.mountpoint))
                else:
                    out.append(None)
                results[name] = out
                return out

            # ---- walk
            walk(src / "walk")  # the source warm
            counts: dict[str, Any] = {}

            def walk_rate(root: Path) -> float:
                # The kernel's dentries and inodes of a first walk: memory warmed for each side
                warm_memory(walk_files * WALK_BYTES_PER_ENTRY)
                if root == mroot:
                    counts["walk0"] = stats(mnt)
                seconds, n = walk(root / "walk")
                if root == mroot:
                    counts["walk1"] = stats(mnt)
                assert n == walk_files, (root, n)
                return n / seconds

            # The first FUSE walk since boot also grows the kernel's inode and dentry caches
            # (slab pages, each object initialised once: a tenth of that walk's CPU): grown
            # here once, by a walk of a mount thrown away, for both FUSE sides alike (else
            # the side walked second, squashfuse_ll, would find them grown by the first).
            cache.mount(mnt)
            walk(mroot / "walk")
            three("walk", walk_rate, fresh=True)

            # ---- reads
            def read_pass(reader: Callable[[list[str]], float], warm: bool) -> Callable[..., float]:
                def rate(root: Path) -> float:
                    paths = [str(root / r) for r in read_rel]
                    if not warm:
                        return len(paths) / reader(paths)
                    reader(paths)
                    best = min(reader(paths) for _ in range(args.repeat))
                    return len(paths) / best

                return rate

            cache.unmount(mnt)
            cache.mount(mnt)
            if squash is not None:
                squash.mount()
            for name, reader in (("pass 1 os.read", os_reads),):

                def first(root: Path, reader: Callable[[list[str]], float] = reader) -> float:
                    warm_memory(len(read_rel) * args.size)  # the page cache this pass fills
                    if root == mroot:
                        counts["p1_0"] = stats(mnt)
                    r = len(read_rel) / reader([str(root / x) for x in read_rel])
                    if root == mroot:
                        counts["p1_1"] = stats(mnt)
                    return r

                drop_caches()
                out: list[float | None] = [read_pass(os_reads, True)(src), first(mroot)]
                out.append(first(squash.mountpoint) if squash is not None else None)
                results[name] = out
            # Pass 1 as a training job reads it: buffered open() asks isatty (an IOCTL) first.
            cache.unmount(mnt)
            cache.mount(mnt)
            if squash is not None:
                squash.mount()
            drop_caches()
            timed: list[float | None] = [read_pass(buffered_reads, True)(src)]
            counts["bp1_0"] = stats(mnt)
            warm_memory(len(read_rel) * args.size)
            timed.append(len(read_rel) / buffered_reads([str(mroot / x) for x in read_rel]))
            counts["bp1_1"] = stats(mnt)
            if squash is not None:
                warm_memory(len(read_rel) * args.size)
                paths = [str(squash.mountpoint / x) for x in read_rel]
                timed.append(len(paths) / buffered_reads(paths))
            else:
                timed.append(None)
            results["pass 1 buffered open().read()"] = timed
            # The same after a listing of the tree (ImageFolder lists before its first epoch):
            # READDIRPLUS gives the mount's entries, so its reads need no LOOKUP.
            cache.unmount(mnt)
            cache.mount(mnt)
            if squash is not None:
                squash.mount()
            drop_caches()
            after_listing: list[float | None] = [None]
            for root in (mroot, squash.mountpoint if squash is not None else None):
                if root is None:
                    after_listing.append(None)
                    continue
                for _ in os.walk(root / "read"):
                    pass
                warm_memory(len(read_rel) * args.size)
                if root == mroot:
                    counts["lp1_0"] = stats(mnt)
                after_listing.append(
                    len(read_rel) / buffered_reads([str(root / x) for x in read_rel])
                )
                if root == mroot:
                    counts["lp1_1"] = stats(mnt)
            results["pass 1 buffered, listed first"] = after_listing
            three("pass 2 os.read", read_pass(os_reads, True))
            counts["buf0"] = stats(mnt)
            three("pass 2 buffered open().read()", read_pass(buffered_reads, True))
            counts["buf1"] = stats(mnt)

            # ---- polling through bursts (fuse_poll_us, off by default): what it gives a tight
            # loop, and what it costs readers that compute between files; on against off
            if args.poll_us and "env" in inspect.signature(cache.mount).parameters:
                mount_paths = [str(mroot / r) for r in read_rel]
                polling: dict[str, list[float]] = {"on": [], "off": []}
                for _ in range(2):
                    for side, us in (("on", args.poll_us), ("off", 0)):
                        cache.mount(mnt, env={"KSPEEDFS_FUSE_POLL_US": str(us)})
                        buffered_reads(mount_paths)
                        tight = len(mount_paths) / min(
                            buffered_reads(mount_paths) for _ in range(args.repeat)
                        )
                        polling[side] += [tight, computing_readers(mount_paths)]
                results["poll"] = [
                    max(polling[side][i::2]) for side in ("on", "off") for i in (0, 1)
                ]
                cache.mount(mnt)

            # ---- FUSE over io_uring (fuse_uring, off by default) against /dev/fuse
            uring_rounds: dict[str, list[tuple[float, float, float]]] = {"uring": [], "classic": []}
            if args.uring:
                switch = Path("/sys/module/fuse/parameters/enable_uring")
                before = switch.read_text() if switch.exists() else None
                src_paths = [str(src / r) for r in read_rel]
                mount_paths = [str(mroot / r) for r in read_rel]
                try:
                    for i in range(args.uring):
                        sides = ("uring", "classic") if i % 2 == 0 else ("classic", "uring")
                        for side in sides:
                            on = "1" if side == "uring" else "0"
                            cache.mount(mnt, env={"KSPEEDFS_FUSE_URING": on})
                            buffered_reads(mount_paths)
                            m_rate = len(mount_paths) / min(
                                buffered_reads(mount_paths) for _ in range(args.repeat)
                            )
                            s_rate = len(src_paths) / min(
                                buffered_reads(src_paths) for _ in range(args.repeat)
                            )
                            computing = computing_readers(mount_paths)
                            through = stats(mnt).get("uring", 0)
                            if side == "uring" and not through:
                                print("  fuse_uring: this mount served nothing through rings")
                            uring_rounds[side].append((m_rate, s_rate, computing))
                finally:
                    if before is not None and os.geteuid() == 0:
                        switch.write_text(before)
                cache.mount(mnt)

            # ---- ImageFolder over the tar view against the extracted tree, same mount
            if tars:
                results["tar"] = imagefolder_tar(mnt, args.repeat)
            if squash is not None:
                squash.unmount()

        print(
            f"\nkspeedfs small files ({walk_files:,} walked; {args.files:,} read of "
            f"{args.size:,} B); the machine may be shared and loaded"
        )
        print(f"  {halt_polling()}")
        print(f"  {'':<34}{'source':>12}{'mount':>12}{'squashfuse':>12}")
        passes = (
            "walk",
            "pass 1 os.read",
            "pass 1 buffered open().read()",
            "pass 1 buffered, listed first",
            "pass 2 os.read",
            "pass 2 buffered open().read()",
        )
        for name in passes:
            row(name, results[name], "files/s")
        print()
        for name, target in (
            ("walk", "walk"),
            ("pass 2 buffered open().read()", "buffered"),
        ):
            s, m, _ = results[name]
            print(f"  {name}: mount/source {ratio(m, s)} (target >= {TARGETS[target]})")
        for name in passes:
            _, m, q = results[name]
            print(f"  {name}: mount/squashfuse {ratio(m, q)} (target >= {TARGETS['squash']})")
        for name in (
            "pass 1 os.read",
            "pass 1 buffered open().read()",
            "pass 1 buffered, listed first",
        ):
            _, m, q = results[name]
            print(f"  {name}: µs per file, mount {micros(m)}, squashfuse_ll {micros(q)}")
        n = walk_files
        print(f"  requests per file, first walk: {per_file(counts['walk0'], counts['walk1'], n)}")
        print(
            f"  requests per file, pass 1: {per_file(counts['p1_0'], counts['p1_1'], args.files)}"
        )
        print(
            "  requests per file, buffered pass 1 (squashfuse_ll keeps no count): "
            + per_file(counts["bp1_0"], counts["bp1_1"], args.files)
        )
        print(
            "  requests per file, buffered pass 1 after a listing: "
            + per_file(counts["lp1_0"], counts["lp1_1"], args.files)
        )
        reads = args.files * (args.repeat + 1)
        print(
            f"  requests per file, buffered pass 2: {per_file(counts['buf0'], counts['buf1'], reads)}"
        )
        if "poll" in results:
            tight_on, computing_on, tight_off, computing_off = results["poll"]
            print(
                f"  fuse_poll_us {args.poll_us} against 0 (the default): buffered pass 2 "
                f"{tight_on:,.0f} against {tight_off:,.0f} files/s ({ratio(tight_on, tight_off)}), "
                f"mount/source {ratio(tight_on, results['pass 2 buffered open().read()'][0])}; "
                f"two readers computing between files {computing_on:,.0f} against "
                f"{computing_off:,.0f} files/s ({ratio(computing_on, computing_off)})"
            )
        for side in ("uring", "classic") if args.uring else ():
            rounds = uring_rounds[side]
            print(
                f"  buffered pass 2, fuse_uring {'on' if side == 'uring' else 'off'}: mount "
                + " ".join(f"{m:,.0f}" for m, _, _ in rounds)
                + " files/s; source "
                + " ".join(f"{s:,.0f}" for _, s, _ in rounds)
                + "; mount/source "
                + " ".join(ratio(m, s) for m, s, _ in rounds)
                + "; two readers computing between files "
                + " ".join(f"{c:,.0f}" for _, _, c in rounds)
                + " files/s"
            )
        if tars:
            view, tree = results["tar"]
            print(
                f"  ImageFolder epoch, tar view {view:,.0f} files/s against the extracted tree "
                f"{tree:,.0f} (same mount): {ratio(view, tree)} "
                f"(target >= {TARGETS['tar_imagefolder']})"
                if view
                else "  ImageFolder over the tar view: n/a (no tar view in this tree)"
            )
    if args.members:
        return untar_bench(args)
    return 0


def micros(rate: float | None) -> str:
    return f"{1e6 / rate:,.0f}" if rate else "n/a"


def make_untar_source(root: Path, members: int, shards: int, size: int, classes: int) -> None:
    """`shards/train-NNNN.tar`: member i is `train/nCCCC/IIIIIII.JPEG` of class i % classes in
    shard i % shards (every class in every shard, as ImageNet's and LAION's shards are), and
    `extracted/`: what extracting them gives."""
    rng = random.Random(2)
    (root / "shards").mkdir(parents=True)
    for c in range(classes):
        (root / "extracted" / "train" / f"n{c:04d}").mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(
            root / "shards" / f"train-{s:04d}.tar", "w", format=tarfile.USTAR_FORMAT
        ) as out:
            for i in range(s, members, shards):
                rel = f"train/n{i % classes:04d}/{i:07d}.JPEG"
                data = rng.randbytes(size)
                (root / "extracted" / rel).write_bytes(data)
                info = tarfile.TarInfo(rel)
                info.size = size
                out.addfile(info, io.BytesIO(data))
                out.members = []  # one TarInfo at a time


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def private_kib(pid: int) -> int:
    """Anonymous memory of a process (its own heap: what a table built in it costs)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def untar_bench(args: argparse.Namespace) -> int:
    """The merged tar view's section (see the module's doc)."""
    from torchvision.datasets import DatasetFolder

    n, shards, size = args.members, args.untar_shards, args.member_size
    with tempfile.TemporaryDirectory(prefix="kspeedfs-bench-untar-", dir=args.tmp) as tmp_:
        tmp = Path(tmp_)
        src = tmp / "src"
        started = time.perf_counter()
        make_untar_source(src, n, shards, size, min(args.classes, n))
        print(
            f"made {n:,} members in {shards:,} tars and their extraction in "
            f"{time.perf_counter() - started:.0f}s"
        )
        tar_bytes = sum(p.stat().st_size for p in (src / "shards").iterdir())
        cache = LocalCache(tmp / "work", n * 2048 + 2 * tar_bytes + (512 << 20))
        mnt = tmp / "mnt"
        with cache:
            started = time.perf_counter()
            cache.preload(src, "ds", show_progress=False)
            print(f"preloaded in {time.perf_counter() - started:.0f}s")
            m = cache.mount(mnt)
            pid = cache.mount_pid(mnt)
            workers = descendants(pid) if pid else []
            before = {w: private_kib(w) for w in workers}
            stats0 = stats(mnt)
            started = time.perf_counter()
            listed = sum(len(names) for _d, _s, names in os.walk(mnt / "ds@untar"))
            list_s = time.perf_counter() - started
            stats1 = stats(mnt)
            grown = {w: private_kib(w) - kib for w, kib in before.items()}
            built = [ln for ln in m.log_path.read_text().splitlines() if "ds@untar:" in ln]
            ds = {}
            roots = {
                "view": mnt / "ds@untar" / "shards" / "train",  # each tar into its folder
                "extracted, same mount": mnt / "ds" / "extracted" / "train",
                "extracted, source": src / "extracted" / "train",
            }
            # Each side scanned right before its epoch: a scan of another side's 1.28 M
            # entries in between would push this side's out of the kernel's dentry cache.
            scan_s: dict[str, float] = {}
            epochs: dict[str, list[float]] = {}
            asked: dict[str, str] = {}
            order: list[int] = []
            for side, root in roots.items():
                started = time.perf_counter()
                ds[side] = DatasetFolder(str(root), loader=_load, extensions=(".jpeg",))
                scan_s[side] = time.perf_counter() - started
                if not order:
                    order = list(range(len(ds[side])))
                    random.Random(3).shuffle(order)
                    order = order[: args.epoch_files]
                epochs[side] = []
                before_epoch = stats(mnt)
                for _ in range(2):  # pass 1 (the mount's first reads), pass 2 (page cache)
                    started = time.perf_counter()
                    for i in order:
                        ds[side][i]
                    epochs[side].append(len(order) / (time.perf_counter() - started))
                if root.is_relative_to(mnt):
                    asked[side] = per_file(before_epoch, stats(mnt), 2 * len(order))
        print(
            f"\nkspeedfs merged tar view: {n:,} members of {size} B in {shards:,} tars "
            f"({tar_bytes / 2**20:,.0f} MiB); the machine may be shared and loaded"
        )
        print(
            f"  a fresh mount lists ds@untar/ ({listed:,} files, its table built) in "
            f"{list_s:.1f}s: {list_s / max(listed, 1) * 1e6:.1f} µs per member; requests "
            f"{per_file(stats0, stats1, max(listed, 1))} per member"
        )
        for line in built:
            print(f"  mount log: {line.split('ds@untar: ', 1)[-1]}")
        for w, kib in grown.items():
            print(
                f"  serving process {w}: +{kib / 1024:,.1f} MiB anonymous memory "
                f"({kib * 1024 / max(n, 1):,.0f} B per member)"
            )
        print("  ImageFolder scan: " + ", ".join(f"{k} {v:.1f}s" for k, v in scan_s.items()))
        for side, line in asked.items():
            print(f"  requests per sample read, {side} (two passes): {line}")
        for side, (p1, p2) in epochs.items():
            print(
                f"  ImageFolder epoch ({len(order):,} samples, shuffled), {side}: pass 1 "
                f"{p1:,.0f}, pass 2 {p2:,.0f} files/s"
            )
        for k in (0, 1):
            view = epochs["view"][k]
            print(
                f"  pass {k + 1}: view/extracted same mount "
                f"{ratio(view, epochs['extracted, same mount'][k])} (target >= "
                f"{TARGETS['tar_imagefolder']}), view/extracted on the source "
                f"{ratio(view, epochs['extracted, source'][k])}"
            )
    return 0


def _load(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def crc_after_read(path: str) -> int:
    """One file read and computed over (about 0.5 ms of CPU here, as a small JPEG's decode)."""
    with open(path, "rb") as f:
        data = f.read()
    return zlib.crc32(data * COMPUTE_REPEAT)


def computing_readers(paths: list[str]) -> float:
    """Files/s of two processes taking files in turn, each computing over what it read: the
    shape of DataLoader workers, whose requests come far apart."""
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(crc_after_read, paths[:64])  # the workers started
        started = time.perf_counter()
        pool.map(crc_after_read, paths, chunksize=16)
        return len(paths) / (time.perf_counter() - started)


def imagefolder_tar(mnt: Path, repeat: int) -> list[float | None]:
    """Files/s of a stock ImageFolder epoch (raw bytes loader) over `ds@tar/tars/<shard>/`
    against the same over `read/` of the same mount; None for a tree without the view."""
    try:
        from torchvision.datasets import DatasetFolder
    except ImportError:
        return [None, None]

    def load(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def epoch(root: Path) -> float:
        ds = DatasetFolder(str(root), loader=load, extensions=(".jpg",))
        started = time.perf_counter()
        for i in range(len(ds)):
            ds[i]
        return len(ds) / (time.perf_counter() - started)

    # The view is a folder at the mount's root beside the dataset's; each shard a folder whose
    # classes hold 1/shards of the files: files/s over one shard against the whole tree.
    tars = mnt / "ds@tar" / "tars"
    tree = mnt / "ds" / "read"
    if not tars.exists():
        return [None, epoch(tree)]
    shard = sorted(tars.iterdir())[0]
    best_view = best_tree = 0.0
    for _ in range(repeat + 1):  # the first of each is the cold one: best of the warm kept
        best_view = max(best_view, epoch(shard))
        best_tree = max(best_tree, epoch(tree))
    return [best_view, best_tree]


if __name__ == "__main__":
    sys.exit(main())
