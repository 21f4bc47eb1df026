"""A node with a disk tier, a dataset preloaded onto it, and what a failing disk does to its
segments: the helpers of the integrity tests (test_integrity, test_damage_news)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import NodeProcess, run_cli
from rt_util import EnvNode, make_source, wrong_bytes

from kspeedfs.format.sealing import is_sealed, set_sealed
from kspeedfs.node.segments import segment_fault
from kspeedfs.testing.node import NO_IMMUTABLE

MiB = 1 << 20


def disk_node(
    tmp_path: Path, token_file: Path, scrub_rate: str, sealing: bool = True
) -> NodeProcess:
    """A node with an 8 MiB memory tier and a disk tier; `sealing` False: started without
    CAP_LINUX_IMMUTABLE (it cannot seal its segments)."""
    shm = Path("/dev/shm") / f"kspeedfs-test-{os.urandom(5).hex()}"
    return EnvNode(
        shm,
        token_file,
        tmp_path,
        memory="8MiB",
        extra=("--spill-dir", str(tmp_path / "disk"), "--spill", "64MiB"),
        env_extra={"KSPEEDFS_SCRUB_RATE": scrub_rate},
        wrapper=() if sealing else NO_IMMUTABLE,
    )


def dataset_on_disk(
    tmp_path: Path,
    token_file: Path,
    nodes: list[NodeProcess],
    scrub_rate: str,
    sealing: bool = True,
) -> tuple[NodeProcess, Path, dict[str, bytes], dict[str, Any]]:
    """A started disk_node (in `nodes`) with 20 files of about 150 KB preloaded onto its disk
    tier as "src": the node, the source folder, its files and the dataset's record."""
    node = disk_node(tmp_path, token_file, scrub_rate, sealing)
    nodes.append(node.start())
    src = tmp_path / "src"
    files = make_source(src, 20, 150_000)
    return node, src, files, preload_on_disk(node, src, "src")


def preload_on_disk(node: NodeProcess, src: Path, name: str) -> dict[str, Any]:
    done = run_cli(
        "preload", str(src), "--name", name, "--tier", "disk", "--max-memory", "4KiB", "-q",
        env=node.env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = listing(node)[name]
    assert record["disk"] and len(record["disk"]) == record["segments"], record
    return record


def listing(node: NodeProcess) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in node.request("list")["datasets"]}


def disk_segment(tmp_path: Path, record: dict[str, Any], seg: int) -> Path:
    return tmp_path / "disk" / "tier" / f"{record['name']}.{record['uuid']}" / "seg" / f"{seg:08d}"


def integrity(node: NodeProcess) -> dict[str, Any]:
    found: dict[str, Any] = node.request("status")["integrity"]
    return found


def damage(path: Path, kind: str, where: float, below_the_flag: bool = False) -> bool:
    """What a failing disk or a stray process does to a segment file, in place; False when
    the file is gone (quarantined meanwhile: a reader's earlier report). `below_the_flag`: a
    sealed file's flag is cleared for it (a failing disk, or a deliberate root), and put back
    after a flip (a disk that fails leaves the flag as it was)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    sealed = False
    if below_the_flag:
        fd = os.open(path, os.O_RDONLY)
        try:
            sealed = is_sealed(fd)
            if sealed:
                set_sealed(fd, False)
            harm(path, kind, where, size)
            if sealed and kind == "flip":
                set_sealed(fd, True)
        finally:
            os.close(fd)
        return True
    harm(path, kind, where, size)
    return True


def harm(path: Path, kind: str, where: float, size: int) -> None:
    if kind == "flip":
        pos = min(size - 1, int(where * size))
        with open(path, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x5A]))
    elif kind == "truncate":
        os.truncate(path, int(where * size))
    elif kind == "extend":
        with open(path, "ab") as f:
            f.write(b"\xff" * (1 + int(where * 4096)))
    elif kind == "unlink":
        path.unlink()
    else:  # "replace": another file renamed over it
        other = path.with_name(f".harm-{os.getpid()}")
        other.write_bytes(b"\0" * size)
        try:
            os.rename(other, path)
        finally:
            other.unlink(missing_ok=True)


def all_sound(tmp_path: Path, node: NodeProcess, name: str) -> bool:
    """Every segment of `name` held again, and every disk one sound."""
    record = listing(node).get(name)
    if record is None or len(record["held"]) != record["segments"]:
        return False
    return all(
        not segment_fault(disk_segment(tmp_path, record, seg), *sizes(node, record, seg))
        for seg in record["disk"]
    )


_SIZES: dict[tuple[str, int], tuple[int, int]] = {}


def sizes(node: NodeProcess, record: dict[str, Any], seg: int) -> tuple[int, int]:
    """Segment `seg`'s length and checksum, from the manifest."""
    from kspeedfs.format.manifest import Manifest

    key = (record["uuid"], seg)
    if key not in _SIZES:
        m = Manifest(Path(record["path"]) / "manifest.ksm")
        for k in range(m.segments):
            _SIZES[(record["uuid"], k)] = (int(m.seg_len[k]), int(m.seg_checksum[k]))
    return _SIZES[key]


READER = """
import json, os, sys
from pytorch_ext import KSpeedFolder
src, rels = sys.argv[1], json.loads(sys.argv[2])
fast = KSpeedFolder(src, nodes=os.environ["KSPEEDFS_NODES"], token=os.environ["KSPEEDFS_TOKEN_FILE"])
reader = fast._reader
out = {}
for rel in rels:
    entry = reader.manifest.resolve(os.fsencode(rel))
    out[rel] = [bytes(fast.read(rel)).hex(), bytes(reader.fetch([entry])[entry]).hex()]
print(json.dumps(out))
"""


def read_in_a_new_process(node: NodeProcess, src: Path, files: dict[str, bytes]) -> int:
    """Wrong bytes a new fast-path reader (views and copies) gets; it must not die."""
    done = subprocess.run(
        [sys.executable, "-c", READER, str(src), json.dumps(sorted(files))],
        env=node.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: a SIGBUS
    got = json.loads(done.stdout)
    return sum(wrong_bytes(bytes.fromhex(h), files[rel]) for rel in files for h in got[rel])
