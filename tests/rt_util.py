"""Helpers of the read-through, eviction and S3 tests: nodes with extra environment, mounts of a
source, the node's cache counters, memory actually used in a folder."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from conftest import MountProcess, NodeProcess


def wrong_bytes(got: Any, want: bytes) -> int:
    """Bytes of `got` that differ from `want` (every byte of the longer one when their lengths
    differ)."""
    a = np.frombuffer(bytes(got), dtype=np.uint8)
    b = np.frombuffer(want, dtype=np.uint8)
    return int(np.count_nonzero(a != b)) if len(a) == len(b) else max(len(a), len(b))


@contextlib.contextmanager
def policy_nodes(
    token_file: Path, tmp_path: Path, memory: int, segment: int
) -> Iterator[Callable[..., NodeProcess]]:
    """`start(policy, *extra, memory=memory)`: a started node of its own shm folder with that
    eviction policy; every one stopped and its folder removed at the end."""
    made: list[NodeProcess] = []

    def start(policy: str, *extra: str, memory: int = memory) -> NodeProcess:
        shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
        n = NodeProcess(
            shm,
            token_file,
            tmp_path,
            memory=str(memory),
            segment_size=str(segment),
            extra=("--eviction", policy, *extra),
        )
        made.append(n)
        return n.start()

    try:
        yield start
    finally:
        for n in made:
            n.stop()
            shutil.rmtree(n.shm_dir, ignore_errors=True)


def make_source(
    root: Path, files: int, size: int, seed: int = 0, folders: int = 4
) -> dict[str, bytes]:
    """`files` random files of about `size` bytes each (up to an eighth less), in `folders`
    folders; relative path -> bytes."""
    rng = random.Random(seed)
    made = {}
    for i in range(files):
        rel = f"d{i % folders}/f{i:04d}.bin"
        data = rng.randbytes(size - rng.randint(0, size // 8))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        made[rel] = data
    return made


class EnvNode(NodeProcess):
    """A node (and its clients) with extra environment: credentials, check intervals."""

    def __init__(self, *args: Any, env_extra: dict[str, str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.env_extra = env_extra

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.env_extra}


def cache_status(node: NodeProcess, name: str) -> dict[str, Any]:
    """The node's cache counters of one dataset (hits, misses, in_memory, ...)."""
    found: dict[str, Any] = node.request("status")["cache"]["datasets"][name]
    return found


def mount_source(
    node: NodeProcess,
    tmp_path: Path,
    mounts: list[MountProcess],
    source: str | Path,
    *extra: str,
    mnt: str = "mnt",
    env: dict[str, str] | None = None,
) -> MountProcess:
    m = MountProcess(
        tmp_path / mnt, env or node.env(), tmp_path, args=("--source", str(source), *extra)
    )
    mounts.append(m)
    return m.start()


def shm_bytes(path: Path) -> int:
    """Memory (tmpfs pages) or disk the files under path take, not their apparent sizes."""
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def file_count(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file())


def read_uncached(path: Path) -> bytes:
    """Read a file through a mount, past the kernel's page cache (so the daemon serves it)."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return f.read()


def deleted_maps(pid: int, folder: Path) -> list[str]:
    """Mappings a process still holds of unlinked files under folder (memory not returned)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if str(folder) in line and "(deleted)" in line]


def write_files(root: Path, count: int, size: int, subdirs: int = 2) -> dict[str, bytes]:
    """count files of `size` random bytes spread over subfolders; relative path -> bytes."""
    out = {}
    for i in range(count):
        rel = f"d{i % subdirs}/file{i:04d}.bin"
        data = os.urandom(size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out
