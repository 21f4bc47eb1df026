"""Decoded-sample cache benchmark: DataLoader images/s in epoch 2, stock ImageFolder vs the
decoded variant, the fill rate and the variant's memory.

    .venv/bin/python bench/bench_decoded.py [--files 20000] [--size 256] [--cache DIR]

Generates ~110 KB JPEGs in class folders once (reused after), preloads them into a private
node with a decoded variant at --size, then prints, for DataLoader(2 workers, batch 32, shuffle),
the images/s of the second epoch beside stock `ImageFolder` on the source with the usual train
transform (RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize):
  door 1 with the stock transform; door 1 with decode="tensor" and the same augmentation in
  torchvision.transforms.v2 on the uint8 view (float32 normalized out); the same with uint8
  out (pytorch_ext.transforms.train, normalisation left to the GPU);
  door 2: stock ImageFolder on the mount's NAME@N folder (PPM files), the same stock transform;
  the floor: a dataset returning a ready float32 / uint8 3x224x224 tensor (what the loader
  itself costs: collate and the samples crossing shared memory);
the fill rate of the node (header pass + plan, then decoding) beside the rate of one process
decoding+resizing the same way (a pool worker set up as the fill's) times the cores, and
the variant's bytes beside the JPEG bytes.
Targets (issue 13): door 1 and door 2 stock >= 1.8x; v2 float >= 2.7x; uint8 >= 5x; fill >=
0.8 of the cores' decode rate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision import datasets  # noqa: E402

from kspeedfs.client import admin  # noqa: E402
from kspeedfs.client import decoded as decoded_client  # noqa: E402
from kspeedfs.demo import ensure_sample, train_transform  # noqa: E402
from kspeedfs.format import decoded as fmt  # noqa: E402
from kspeedfs.format.units import format_size  # noqa: E402
from kspeedfs.node import decoded as node_decoded  # noqa: E402
from kspeedfs.testing.bench import warm_memory  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import KSpeedImageFolder  # noqa: E402
from pytorch_ext import transforms as kt  # noqa: E402


def epoch2(ds: Dataset[Any], workers: int, batch: int) -> float:
    """Images/s of the second of two epochs (a fresh loader each: workers started in both)."""
    rate = 0.0
    for _ in range(2):
        loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
        started = time.perf_counter()
        n = 0
        for images, _targets in loader:
            n += len(images)
        rate = n / (time.perf_counter() - started)
    return rate


def decode_loop(paths: list[str], size: int) -> tuple[float, float]:
    """(images/s, CPU seconds per image) of decoding + resizing files already in memory."""
    blobs = [Path(p).read_bytes() for p in paths]
    started, cpu = time.perf_counter(), time.process_time()
    for data in blobs:
        fmt.decode_image(data, size)
    return len(blobs) / (time.perf_counter() - started), (time.process_time() - cpu) / len(blobs)


def single_process_decode_rate(source: Path, size: int, count: int) -> tuple[float, float]:
    """(images/s, CPU s per image) of one process decoding + resizing files already in memory,
    set up as the fill's pool workers are (a forkserver child, the same malloc settings):
    without them PIL decodes up to ~1.7x slower, and the ratio would flatter the fill."""
    paths = sorted(str(p) for p in source.rglob("*") if p.is_file())[:count]
    ctx = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=ctx, initializer=node_decoded._init_worker
    ) as pool:
        return pool.submit(decode_loop, paths, size).result()


class SessionCPU:
    """CPU seconds used by the processes of a session (the node, its pool's workers, the
    forkserver) while it runs: /proc sampled every 0.2 s, each process's last figure kept (a
    pool's workers exit with it)."""

    def __init__(self, sid: int):
        self.sid = sid
        self.seen: dict[int, float] = {}
        self.base = self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[int, float]:
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[int, float] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.sid:
                out[int(pid)] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.seen.update(self._sample())

    def __enter__(self) -> SessionCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seen.update(self._sample())

    def used(self, pid: int | None = None) -> float:
        """CPU seconds of every process of the session, or of one."""
        seen = self.seen if pid is None else {pid: self.seen.get(pid, 0.0)}
        return sum(cpu - self.base.get(p, 0.0) for p, cpu in seen.items())


class ReadyTensors(Dataset[Any]):
    """The floor: samples that cost nothing to make (the same 3x224x224 tensor each time)."""

    def __init__(self, n: int, dtype: torch.dtype):
        self.n = n
        self.sample = torch.zeros(3, 224, 224, dtype=dtype)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sample, 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--size", type=int, default=256, help="the variant's shorter side")
    p.add_argument("--file-size", default="110KiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--mount-workers", default="default", help="door 2: the mount's --workers, e.g. 1,2"
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench-decoded")
    p.add_argument(
        "--fill-only", action="store_true", help="the fill line alone (no DataLoader epochs)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    per_class = max(1, args.files // args.classes)
    source = ensure_sample(
        Path(args.cache) / f"set-{args.classes}x{per_class}-{args.file_size}",
        args.classes,
        per_class,
        args.file_size,
    )
    files = [q for q in source.rglob("*") if q.is_file()]
    jpeg_bytes = sum(q.stat().st_size for q in files)
    print(f"data set: {len(files)} files, {format_size(jpeg_bytes)}, {source}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    cores = os.cpu_count() or 1
    # The reference just before the fill and again just after (a shared machine's load moves
    # between the two): the fill is set against their mean.
    reference = [single_process_decode_rate(source, args.size, min(300, len(files)))]

    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-decoded-"))
    budget = 4 * jpeg_bytes + 3 * len(files) * args.size * args.size * 2 + (256 << 20)
    with LocalCache(workdir, budget) as node:
        node.preload(source.parent, "bench", show_progress=False)
        # The variant's memory is claimed during the fill: faulted in once beforehand, as the
        # reference's reused buffers are, or the fill pays the VM's first-touch cost alone.
        warm_memory(2 * 3 * len(files) * args.size * args.size)
        with admin.connect(node.settings) as client, SessionCPU(node.node.proc.pid) as cpu:
            started = time.perf_counter()
            decoded_client.start(client, "bench", args.size)
            planned = time.perf_counter()
            v = decoded_client.wait(client, "bench", args.size)
            fill_s = time.perf_counter() - started
        fill_rate = v.files_total / fill_s
        decode_rate = v.files_total / (fill_s - (planned - started))
        reference.append(single_process_decode_rate(source, args.size, min(300, len(files))))
        single = sum(r for r, _ in reference) / len(reference)
        ref_cpu = sum(c for _, c in reference) / len(reference)
        fill_cpu = cpu.used() / v.files_total
        print(
            f"\nfill: {v.files_total} images in {fill_s:.1f}s = {fill_rate:.0f} img/s on "
            f"{cores} cores (header pass + plan {planned - started:.2f}s, then decoding at "
            f"{decode_rate:.0f} img/s); one process decoding+resizing: {single:.0f} img/s "
            f"(before {reference[0][0]:.0f}, after {reference[1][0]:.0f}; x{cores} = "
            f"{single * cores:.0f}); load average {os.getloadavg()[0]:.2f}; ratio "
            f"{fill_rate / (single * cores):.2f}, decoding alone "
            f"{decode_rate / (single * cores):.2f} (target >= 0.8)"
        )
        print(
            f"fill CPU: {fill_cpu * 1e3:.2f} ms per image (the node's processes: node, pool, "
            f"forkserver; {cpu.used():.1f}s, the node's own {cpu.used(cpu.sid):.1f}s) against {ref_cpu * 1e3:.2f} ms decoding+resizing "
            f"in one process: {ref_cpu / fill_cpu:.2f} of the fill's CPU is decode+resize; "
            f"the fill had {cpu.used() / fill_s:.2f} of {cores} cores"
        )
        print(
            f"memory: variant {format_size(v.bytes)} vs JPEG {format_size(jpeg_bytes)} "
            f"({v.bytes / jpeg_bytes:.2f}x), {v.undecodable} undecodable"
        )
        if args.fill_only:
            return

        kw: dict[str, Any] = {"nodes": str(node.address), "token": str(node.token_file)}
        stock = epoch2(
            datasets.ImageFolder(str(source), train_transform()), args.workers, args.batch
        )
        rows: list[tuple[str, float, float | None]] = [
            ("stock ImageFolder on the source, stock transform", stock, None)
        ]
        configs: list[tuple[str, dict[str, Any], Any, float]] = [
            ("door 1, stock transform (PIL over the pixels)", {}, train_transform(), 1.8),
            (
                "door 1, decode=tensor, v2 on the uint8 view, float out",
                {"decode": "tensor"},
                kt.train(224, normalize=True),
                2.7,
            ),
            (
                "door 1, decode=tensor, v2, uint8 out (transforms.train)",
                {"decode": "tensor"},
                kt.train(224),
                5.0,
            ),
        ]
        for label, extra, tfm, target in configs:
            ds = KSpeedImageFolder(str(source), transform=tfm, decoded=args.size, **extra, **kw)
            rows.append((label, epoch2(ds, args.workers, args.batch), target))
        for mount_workers in args.mount_workers.split(","):
            extra_args = () if mount_workers == "default" else ("--workers", mount_workers)
            mount = node.mount(workdir / f"mnt-{mount_workers}", *extra_args)
            door2 = mount.mountpoint / f"bench@{args.size}" / source.name
            ds2 = datasets.ImageFolder(str(door2), train_transform())
            assert len(ds2) == len(files), f"{door2} shows {len(ds2)} images"
            rows.append(
                (
                    f"door 2, stock ImageFolder on the mount's @N folder ({mount_workers} workers)",
                    epoch2(ds2, args.workers, args.batch),
                    1.8,
                )
            )
            node.unmount(mount.mountpoint)
        for dtype in (torch.float32, torch.uint8):
            floor = epoch2(ReadyTensors(len(files), dtype), args.workers, args.batch)
            rows.append((f"floor: dataset returning a ready {dtype} tensor", floor, None))
        print(f"\nDataLoader epoch 2, {args.workers} workers, batch {args.batch}, shuffle:")
        for label, rate, tgt in rows:
            ratio = f"{rate / stock:5.2f}x" + (f" (target >= {tgt}x)" if tgt else "")
            print(f"  {label:68s} {rate:7.0f} img/s  {ratio}")


if __name__ == "__main__":
    main()
