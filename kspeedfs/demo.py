"""The built-in end-to-end run: private node, sample dataset, preload, mount, ImageFolder epochs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from . import admin, auth
from .client import NodeClient
from .config import Settings
from .errors import KSpeedError, MountError, NodeUnreachable
from .units import Address, format_size, parse_size

log = logging.getLogger(__name__)

KSPEEDFS = [sys.executable, "-m", "kspeedfs.cli"]
SAMPLE_FILE_SIZE = "110KiB"
NODE_START_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCache:
    """A private node (own port, shm folder, token, empty config) and the mounts made on it.

    Nothing of the user's is read or touched: KSPEEDFS_* variables are dropped from the
    children's environment and the config file is an empty one in the work folder.
    """

    def __init__(self, workdir: Path, memory: int, segment_size: str = "64MiB"):
        self.workdir = workdir
        self.memory = memory
        self.segment_size = segment_size
        self.address = Address("127.0.0.1", _free_port())
        self.shm_dir = Path("/dev/shm") / f"kspeedfs-demo-{uuid.uuid4().hex[:10]}"
        self.token_file = workdir / "token"
        self.config_file = workdir / "empty.toml"
        self.node_log = workdir / "node.log"
        self.node: subprocess.Popen[bytes] | None = None
        self.mountpoints: list[Path] = []
        self.settings = Settings(
            listen=self.address, nodes=[self.address], token_file=self.token_file, timeout=30.0
        )

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
        env["KSPEEDFS_CONFIG"] = str(self.config_file)
        env["KSPEEDFS_TOKEN_FILE"] = str(self.token_file)
        env["KSPEEDFS_NODES"] = str(self.address)
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text("")
        if not self.token_file.exists():
            auth.write_token(self.token_file, auth.new_admin_token())
        with open(self.node_log, "ab") as out:
            # A session of its own: Ctrl-C reaches only us, and we stop the node in order.
            self.node = subprocess.Popen(
                [
                    *KSPEEDFS,
                    "node",
                    "--listen",
                    str(self.address),
                    "--shm-dir",
                    str(self.shm_dir),
                    "--memory",
                    str(self.memory),
                    "--segment-size",
                    self.segment_size,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        deadline = time.monotonic() + NODE_START_TIMEOUT
        while True:
            if self.node.poll() is not None:
                tail = self.node_log.read_text(errors="replace").strip().splitlines()[-1:]
                raise NodeUnreachable(f"the demo node exited: {' '.join(tail)}")
            try:
                with NodeClient(self.address, self.token_file, timeout=5) as c:
                    c.request("ping")
                return
            except NodeUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def preload(self, source: Path, name: str, show_progress: bool = True) -> dict[str, Any]:
        return admin.preload(self.settings, str(source), name, show_progress=show_progress)

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        with NodeClient(self.address, self.token_file, self.settings.timeout) as c:
            return c.request(op, **args)

    def mount(self, mountpoint: Path, *extra: str) -> None:
        """`kspeedfs mount` in the background, as a user runs it; returns once it is up."""
        mountpoint.mkdir(parents=True, exist_ok=True)
        _unmount_stale(mountpoint)
        done = subprocess.run(
            [
                *KSPEEDFS,
                "mount",
                str(mountpoint),
                "--log-file",
                str(self.workdir / f"mount-{mountpoint.name}.log"),
                *extra,
            ],
            env=self.env(),
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise MountError(
                done.stderr.strip().splitlines()[-1] if done.stderr else "mount failed"
            )
        self.mountpoints.append(mountpoint)

    def mount_pid(self, mountpoint: Path) -> int | None:
        """The pid of the process serving this mount (for CPU accounting)."""
        pids = _mount_pids(mountpoint)
        return pids[0] if pids else None

    def unmount(self, mountpoint: Path) -> None:
        pids = _mount_pids(mountpoint)
        done = subprocess.run(
            [*KSPEEDFS, "umount", str(mountpoint)], env=self.env(), capture_output=True, text=True
        )
        if done.returncode != 0 and os.path.ismount(mountpoint):
            log.warning("unmount of %s failed (%s); unmounting lazily", mountpoint, done.stderr)
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        for pid in pids:
            _wait_or_kill(pid)
        if mountpoint in self.mountpoints:
            self.mountpoints.remove(mountpoint)

    def close(self) -> None:
        """Unmount everything, stop the node, free its memory; safe to call more than once."""
        for mountpoint in list(self.mountpoints):
            try:
                self.unmount(mountpoint)
            except Exception as e:  # keep cleaning up the rest
                log.error("cannot unmount %s: %s", mountpoint, e)
        if self.node is not None and self.node.poll() is None:
            self.node.send_signal(signal.SIGTERM)
            try:
                self.node.wait(15)
            except subprocess.TimeoutExpired:
                self.node.kill()
                self.node.wait()
        self.node = None
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def __enter__(self) -> LocalCache:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mount_pids(mountpoint: Path) -> list[int]:
    """Pids of the `kspeedfs mount` processes serving exactly this mountpoint."""
    target = str(mountpoint)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"kspeedfs.cli" in argv and b"mount" in argv and os.fsencode(target) in argv:
            pids.append(int(entry))
    return pids


def _wait_or_kill(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _unmount_stale(mountpoint: Path) -> None:
    """A mount left behind by a killed earlier run would make the mountpoint busy."""
    try:
        busy = os.path.ismount(mountpoint)
    except OSError:
        busy = True  # "transport endpoint is not connected": a dead FUSE mount
    if busy:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


def train_transform() -> Any:
    """The standard ImageNet training transform."""
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )


def run_epoch(root: Path, workers: int, batch_size: int = 32) -> tuple[int, float, list[str]]:
    """One epoch of stock ImageFolder + DataLoader; returns (images, seconds, classes)."""
    from torch.utils.data import DataLoader
    from torchvision import datasets

    started = time.perf_counter()
    dataset = datasets.ImageFolder(str(root), transform=train_transform())
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=False,
    )
    images = 0
    for batch, _targets in loader:
        images += int(batch.shape[0])
    return images, time.perf_counter() - started, list(dataset.classes)


def ensure_sample(dest: Path, classes: int, per_class: int, size: str = SAMPLE_FILE_SIZE) -> Path:
    """Generate the sample under dest/train once; a stamp records what was made."""
    from .sample import make_sample

    stamp = dest.with_name(dest.name + ".json")  # beside it: not part of the dataset
    want = {"classes": classes, "per_class": per_class, "size": size}
    try:
        if json.loads(stamp.read_text()) == want:
            print(f"reusing the sample dataset in {dest}")
            return dest / "train"
    except (OSError, ValueError):
        pass
    shutil.rmtree(dest, ignore_errors=True)
    started = time.monotonic()
    n, nbytes = make_sample(dest / "train", classes, per_class, parse_size(size))
    stamp.write_text(json.dumps(want))
    print(
        f"generated {n} images ({format_size(nbytes)}) in {dest} "
        f"in {time.monotonic() - started:.1f}s"
    )
    return dest / "train"


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the cleanup below runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(workdir: Path, classes: int, per_class: int, workers: int) -> int:
    """Node, sample, preload, mount, one epoch over each of mount and source; 0 on success."""
    logging.getLogger("torch").setLevel(logging.WARNING)  # its exit-time INFO lines are noise
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    source = ensure_sample(workdir / "sample", classes, per_class)
    data_bytes = _dir_bytes(source.parent)
    # Budget: the data, its manifest and slack; the node refuses more than fits in shm.
    memory = data_bytes + data_bytes // 10 + (64 << 20)
    with _sigterm_as_interrupt(), LocalCache(workdir, memory) as cache:
        print(f"node on {cache.address}, shm {cache.shm_dir}, budget {format_size(memory)}")
        started = time.monotonic()
        cache.preload(source.parent, "sample")
        elapsed = time.monotonic() - started
        print(
            f"preloaded {format_size(data_bytes)} in {elapsed:.1f}s "
            f"({data_bytes / 1e6 / max(elapsed, 1e-9):.0f} MB/s)"
        )
        mountpoint = workdir / "mnt"
        cache.mount(mountpoint)
        mounted = mountpoint / "sample" / "train"
        print(f"mounted at {mountpoint}; ImageFolder + DataLoader(num_workers={workers}) epochs:")
        results = {}
        for label, root in (("source", source), ("mount", mounted)):
            n, seconds, found = run_epoch(root, workers)
            results[label] = (n, seconds, found)
            print(f"  {label:<6} {root}: {n} images in {seconds:.1f}s = {n / seconds:.0f} images/s")
        (n_src, s_src, c_src), (n_mnt, s_mnt, c_mnt) = results["source"], results["mount"]
        print(f"  mount/source: {(n_mnt / s_mnt) / (n_src / s_src):.2f}")
        cache.unmount(mountpoint)
        if (n_src, c_src) != (n_mnt, c_mnt):
            raise KSpeedError("the mount and the source disagree on the images or classes")
    print("unmounted, node stopped")
    return 0
