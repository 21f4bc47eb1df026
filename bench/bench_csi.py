"""CSI plugin benchmark: publish-to-ready, read rate in a "pod" against the host, memory, read gaps.

    .venv/bin/python bench/bench_csi.py [--size 1GiB] [--files 1024] [--rounds 3]

Runs a private node, kspeedfs-mountd and `kspeedfs csi` as the DaemonSet does, and drives the
plugin as kubelet does (kspeedfs/csi/harness.py). Prints:
1. publish-to-ready of an inline volume whose dataset is cached (the mount only), and of one
   whose `source` is not (warm: preload, then mount), beside `kspeedfs preload` + `kspeedfs
   mount` of the same source done by hand (the work a warm publish replaces);
2. the read rate of every file through the published volume from a "pod" (a process in a
   mount namespace of its own, `unshare -m`) against the same mount read from the host,
   alternating, each pass past the page cache (POSIX_FADV_DONTNEED); target pod/host >= 0.95;
3. the resident memory of the plugin, mountd and the node;
4. a `decoded` volume (`--images` JPEGs, decoded=N): publish-to-ready when the node has no
   variant yet (the mount starts it), and the images/s of stock ImageFolder (PIL loader) in a
   pod on it, once the variant is filled, against the all-datasets mount's `NAME@N/` from the
   host and against the plain (decoded=0) volume, which decodes each JPEG; each pass past the
   page cache;
5. the read gap a reader sees (reading `--gap-files` files in a loop, each read past the page
   cache) when the volume's mount process is SIGKILLed (a host reader, and a real container
   with the target bound `rslave` where podman, runc and busybox-static are installed) and
   when mountd is SIGKILLed and started again: failed reads (target 0) and the longest gap
   between two good reads (target <= 2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.csi.harness import (
    BUSYBOX,
    CsiClient,
    MountdDaemon,
    PluginDaemon,
    busybox_root,
    container_command,
    inline_context,
    pod_command,
)
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.system.mountinfo import kspeedfs_mounted, lazy_unmount
from kspeedfs.testing.cache import LocalCache
from kspeedfs.testing.node import remove_tree
from kspeedfs.testing.readgap import ContainerReader, HostReader, container_loop

READ_PASS = """
import json, os, sys, time
root = sys.argv[1]
files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
files.sort()
total = 0
start = time.perf_counter()
for path in files:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            total += len(chunk)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": total, "files": len(files)}))
"""


def make_source(root: Path, size: int, files: int) -> Path:
    """`files` files of random bytes in 16 class folders, `size` bytes in all; kept for reuse."""
    marker = root / f".made-{size}-{files}"
    if marker.exists():
        return root
    remove_tree(root)
    each = size // files
    for i in range(files):
        folder = root / f"class{i % 16:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.bin").write_bytes(os.urandom(each))
    marker.write_text("")
    return root


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def read_pass(root: Path, in_pod: bool) -> dict[str, float]:
    argv = [sys.executable, "-c", READ_PASS, str(root)]
    out = subprocess.run(
        pod_command(argv) if in_pod else argv, capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, float] = json.loads(out)
    return result


IMAGES_PASS = """
import json, os, sys, time
from torchvision.datasets import ImageFolder
ds = ImageFolder(sys.argv[1])
for path, _ in ds.samples:  # past the page cache, as in 2.
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
start = time.perf_counter()
for i in range(len(ds)):
    ds[i][0].load()
print(json.dumps({"seconds": time.perf_counter() - start, "images": len(ds)}))
"""


def make_images(root: Path, count: int) -> Path:
    """`count` noisy 500x375 JPEGs in 8 class folders; kept for reuse."""
    import numpy as np
    from PIL import Image

    marker = root / f".made-{count}"
    if marker.exists():
        return root
    remove_tree(root)
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"class{i % 8}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (375, 500, 3), dtype="uint8")
        Image.fromarray(pixels).save(folder / f"img{i:05d}.jpg", "JPEG", quality=85)
    marker.touch()
    return root


def images_pass(root: Path, in_pod: bool) -> float:
    argv = [sys.executable, "-c", IMAGES_PASS, str(root)]
    done = subprocess.run(
        pod_command(argv) if in_pod else argv, capture_output=True, text=True, check=True
    )
    r = json.loads(done.stdout)
    return float(r["images"] / r["seconds"])


def decoded_section(cache: LocalCache, client: CsiClient, target: Any, args: Any) -> None:
    size = args.decoded
    images = make_images(Path(args.cache) / "images", args.images)
    print(f"\n4. a decoded volume: {args.images} JPEGs 500x375, decoded={size}")
    cache.preload(images, "imgs", show_progress=False)  # no variant yet
    vol = target("pod-decoded")
    start = time.perf_counter()
    client.publish("vol-decoded", vol, inline_context("imgs", decoded=str(size)))
    t_decoded = time.perf_counter() - start
    plain = target("pod-plain")
    start = time.perf_counter()
    client.publish("vol-plain", plain, inline_context("imgs"))
    t_plain = time.perf_counter() - start
    print(
        f"   publish-to-ready, variant started by the mount: {t_decoded:.2f} s (plain: {t_plain:.2f} s)"
    )
    start = time.perf_counter()
    while cache.request("decode_status", name="imgs")["variants"][str(size)]["state"] != "ready":
        time.sleep(0.2)
    print(f"   the variant filled {time.perf_counter() - start:.2f} s after the publish answered")
    every = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-every-"))
    cache.mount(every)
    try:
        rates: dict[str, list[float]] = {"pod decoded": [], "host imgs@N": [], "pod plain": []}
        for _ in range(args.rounds):
            rates["pod decoded"].append(images_pass(vol, True))
            rates["host imgs@N"].append(images_pass(every / f"imgs@{size}", False))
            rates["pod plain"].append(images_pass(plain, True))
        med = {k: statistics.median(v) for k, v in rates.items()}
        for k, v in rates.items():
            print(
                f"   {k:12} {med[k]:8.0f} images/s   (passes: {', '.join(f'{x:.0f}' for x in v)})"
            )
        print(
            f"   pod decoded / host imgs@N: {med['pod decoded'] / med['host imgs@N']:.2f}; "
            f"pod decoded / pod plain: {med['pod decoded'] / med['pod plain']:.2f}"
        )
    finally:
        cache.unmount(every)
        remove_tree(every)
    client.unpublish("vol-decoded", vol)
    client.unpublish("vol-plain", plain)


def mount_pid(state_file: Path, target: Path, pid_of_mountd: int | None = None) -> int | None:
    """The pid of the mount at `target`, once mounted (by mountd `pid_of_mountd`, if given)."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return None
    if pid_of_mountd is not None and state.get("pid") != pid_of_mountd:
        return None
    for mount in state["mounts"]:
        if mount["mountpoint"] == str(target) and mount["state"] == "mounted":
            return int(mount["pid"])
    return None


def wait(predicate: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


def gap_section(
    mountd: MountdDaemon, run: Path, env: dict[str, str], work: Path, vol: Path, args: Any
) -> MountdDaemon:
    """Section 5; returns the mountd that runs at its end."""
    print(
        f"\n5. the read gap while the mount process, then mountd, is killed ({args.gap_files} files)"
    )
    paths = sorted(p for p in vol.rglob("*") if p.is_file())[: args.gap_files]
    files = {p: p.read_bytes() for p in paths}
    state = run / "mountd.json"

    def kill_mount_process(reads: Any) -> None:
        wait(lambda: reads.good >= 20)
        pid = mount_pid(state, vol)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait(lambda: mount_pid(state, vol) not in (None, pid))
        good = reads.good
        wait(lambda: reads.good >= good + 20)

    host = HostReader(files).start()
    kill_mount_process(host.reads)
    print("   " + host.stop().line("mount process killed, host reader     "))
    if all(shutil.which(t) for t in ("podman", "runc", BUSYBOX)):
        rel = {str(p.relative_to(vol)): data for p, data in files.items()}
        root = busybox_root(work / "rootfs")
        loop = container_loop(sorted(rel), seconds=30)
        pod = ContainerReader(container_command(root, {vol: "/data"}, loop), rel, vol).start()
        try:
            if pod.first_read(120):
                kill_mount_process(pod.reads)
        finally:
            reads = pod.wait(120)
        print("   " + reads.line("mount process killed, container reader"))
    else:
        print("   (no container reader: podman, runc or busybox-static is missing)")
    host = HostReader(files).start()
    wait(lambda: host.reads.good >= 20)
    mountd.kill9()
    mountd = MountdDaemon(run / "mounts.d", state, env, work).start()
    assert mountd.proc is not None
    wait(lambda: mount_pid(state, vol, mountd.proc.pid if mountd.proc else None) is not None)
    good = host.reads.good
    wait(lambda: host.reads.good >= good + 20)
    print("   " + host.stop().line("mountd killed and restarted, host reader"))
    return mountd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="the uncached source's size")
    parser.add_argument("--files", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="read passes each, alternating")
    parser.add_argument("--cache", default="/var/tmp/kspeedfs-bench-csi", help="source folder")
    parser.add_argument("--images", type=int, default=512, help="JPEGs of the decoded volume")
    parser.add_argument("--decoded", type=int, default=256, help="its decoded size (0: skip)")
    parser.add_argument("--gap-files", type=int, default=16, help="files read in section 5")
    args = parser.parse_args()
    size = parse_size(args.size)
    src = make_source(Path(args.cache), size, args.files)
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-csi-"))
    print(
        f"source: {args.files} files, {format_size(size)} in {src}; load {os.getloadavg()[0]:.1f}"
    )

    with LocalCache(work, memory=3 * size + (256 << 20), segment_size="64MiB") as cache:
        env = cache.env()
        run = work / "run"
        run.mkdir()
        mountd = MountdDaemon(run / "mounts.d", run / "mountd.json", env, work).start()
        plugin = PluginDaemon(run, env, publish_timeout=1800).start()
        client = CsiClient(plugin.socket, timeout=1900)
        pods = work / "pods"
        targets = []
        try:

            def target(name: str) -> Path:
                path = pods / name / "volumes" / "kubernetes.io~csi" / "data" / "mount"
                path.parent.mkdir(parents=True, exist_ok=True)
                targets.append(path)
                return path

            print("\n1. publish-to-ready (NodePublishVolume answered, volume readable)")
            start = time.perf_counter()
            cache.preload(src, "cached", show_progress=False)
            by_hand_preload = time.perf_counter() - start
            hand = work / "by-hand"
            hand.mkdir()
            start = time.perf_counter()
            cache.mount(hand, "--dataset", "cached")
            by_hand_mount = time.perf_counter() - start
            cache.unmount(hand)

            cached = target("pod-cached")
            start = time.perf_counter()
            client.publish("vol-cached", cached, inline_context("cached"))
            t_cached = time.perf_counter() - start
            warm = target("pod-warm")
            start = time.perf_counter()
            client.publish("vol-warm", warm, inline_context("warm", source=str(src)))
            t_warm = time.perf_counter() - start
            print(
                f"   cached dataset:        {t_cached:7.2f} s   (kspeedfs mount by hand {by_hand_mount:.2f} s)"
            )
            print(
                f"   uncached {format_size(size):>8} source: {t_warm:7.2f} s   (kspeedfs preload"
                f" {by_hand_preload:.2f} s + mount {by_hand_mount:.2f} s = "
                f"{by_hand_preload + by_hand_mount:.2f} s; ratio "
                f"{t_warm / (by_hand_preload + by_hand_mount):.2f})"
            )

            print("\n2. read rate of every file, past the page cache: pod vs host, same mount")
            host_rates, pod_rates = [], []
            for _ in range(args.rounds):
                for in_pod, rates in ((False, host_rates), (True, pod_rates)):
                    r = read_pass(cached, in_pod)
                    rates.append(r["bytes"] / r["seconds"])
            host, pod = statistics.median(host_rates), statistics.median(pod_rates)
            print(
                f"   host: {format_size(int(host))}/s   (passes: {', '.join(format_size(int(x)) for x in host_rates)})"
            )
            print(
                f"   pod:  {format_size(int(pod))}/s   (passes: {', '.join(format_size(int(x)) for x in pod_rates)})"
            )
            print(f"   pod / host: {pod / host:.3f}   (target >= 0.95)")

            print("\n3. resident memory (two volumes published)")
            assert plugin.proc is not None and mountd.proc is not None
            assert cache.node.proc is not None
            print(f"   plugin (kspeedfs csi): {format_size(rss(plugin.proc.pid))}")
            print(f"   mountd:                {format_size(rss(mountd.proc.pid))}")
            print(f"   node:                  {format_size(rss(cache.node.proc.pid))}")
            client.unpublish("vol-warm", warm)
            mountd = gap_section(mountd, run, env, work, cached, args)
            client.unpublish("vol-cached", cached)
            if args.decoded:
                decoded_section(cache, client, target, args)
        finally:
            client.close()
            plugin.stop()
            mountd.stop()
            for path in targets:
                if kspeedfs_mounted(path):
                    lazy_unmount(path)
    remove_tree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
