"""Read-through segments cannot be cut short under their readers' maps.

A read-through dataset's segments come and go while readers map them (fills, evictions, the
disk tier, promotion, refresh). A node that may (root: CAP_LINUX_IMMUTABLE) seals each segment
it fills or promotes, and every path that unlinks or links one clears the flag first: epochs
with evictions, a refresh and an unload leave no sealed file and no error behind. A node that
cannot seal leaves its segments writable: a reader then checks a mapped segment's size before
each use, and one cut short under it is read elsewhere, never a SIGBUS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import NodeProcess, run_cli
from rt_util import cache_status, policy_nodes, write_files, wrong_bytes

from kspeedfs.client import admin
from kspeedfs.format.sealing import sealed_beneath
from kspeedfs.testing.node import NO_IMMUTABLE, can_seal
from pytorch_ext import KSpeedFolder

SEGMENT = 256 << 10
pytestmark = pytest.mark.slow


def segment_files(*folders: Path) -> list[str]:
    """Every segment file of a read-through instance under these folders (memory, disk tier)."""
    return sorted(str(p) for f in folders for p in f.glob("**/seg/*") if p.is_file())


def epoch(node: NodeProcess, src: Path, files: dict[str, bytes], seed: int) -> int:
    """Every file once through the fast path, shuffled; the wrong bytes."""
    ds = KSpeedFolder(src, objname="rt", nodes=node.address, token=node.token_file)
    order = np.random.default_rng(seed).permutation(len(ds))
    return sum(wrong_bytes(ds[int(i)], files[ds.files[int(i)]]) for i in order)


def test_filled_segments_are_sealed_and_each_path_that_removes_one_clears_the_flag(
    token_file: Path, tmp_path: Path
) -> None:
    if not can_seal(tmp_path):
        pytest.skip("needs root (CAP_LINUX_IMMUTABLE) and filesystems with the immutable flag")
    src = tmp_path / "src"
    files = write_files(src, 32, SEGMENT)  # 8 MiB: twice the memory, the rest on disk
    disk = tmp_path / "disk"
    with policy_nodes(token_file, tmp_path, 4 << 20, SEGMENT) as start:
        node = start("stable", "--spill-dir", str(disk), "--spill", str(16 << 20))
        admin.register_source(node.settings(), str(src), name="rt")
        assert epoch(node, src, files, seed=0) == 0
        held = segment_files(node.shm_dir, disk)
        st = cache_status(node, "rt")
        assert st["on_disk"] > 0 and st["in_memory"] > 0, st  # both tiers hold some
        assert sorted(sealed_beneath(node.shm_dir) + sealed_beneath(disk)) == held
        for path in held[:: max(1, len(held) // 4)]:
            with pytest.raises(PermissionError):  # even as root
                os.truncate(path, SEGMENT // 2)
        for seed in (1, 2):  # evictions from memory and from the disk tier, promotions
            assert epoch(node, src, files, seed) == 0
        assert sorted(sealed_beneath(node.shm_dir) + sealed_beneath(disk)) == segment_files(
            node.shm_dir, disk
        )
        # A refresh carries the unchanged segments over by hard link (a sealed file refuses
        # one: the flag is cleared for it and set again on the file both names share).
        changed = sorted(files)[0]
        files[changed] = os.urandom(SEGMENT)
        (src / changed).write_bytes(files[changed])
        done = run_cli("refresh", "rt", env=node.env())
        assert done.returncode == 0, done.stderr
        assert epoch(node, src, files, seed=3) == 0
        assert sorted(sealed_beneath(node.shm_dir) + sealed_beneath(disk)) == segment_files(
            node.shm_dir, disk
        )
        node.request("unload", name="rt")
        assert segment_files(node.shm_dir, disk) == [] and sealed_beneath(node.shm_dir) == []
        assert sealed_beneath(disk) == []
        log = node.log()
        assert "Operation not permitted" not in log and "cannot clear" not in log, log[-3000:]


READER = """
import json, os, sys
from pytorch_ext import KSpeedFolder
src, address, token = sys.argv[1:4]
ds = KSpeedFolder(src, objname="rt", nodes=address, token=token)
def read_all():
    return {ds.files[i]: bytes(ds[i]).hex() for i in range(len(ds))}
print(json.dumps(read_all()), flush=True)
sys.stdin.readline()  # the test cuts a segment this process maps
print(json.dumps(read_all()), flush=True)
"""


def test_an_unsealed_segment_cut_short_under_a_reader_is_read_elsewhere(
    token_file: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    files = write_files(src, 8, SEGMENT)
    with policy_nodes(token_file, tmp_path, 8 << 20, SEGMENT) as start:
        node = start("stable")
        if NO_IMMUTABLE:  # root: started without the right to seal, as a non-root node runs
            node.stop()
            node.wrapper = NO_IMMUTABLE
            node.start()
        admin.register_source(node.settings(), str(src), name="rt")
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(src), node.address, str(node.token_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdin is not None and reader.stdout is not None
        first = json.loads(reader.stdout.readline())
        held = segment_files(node.shm_dir)
        assert held and sealed_beneath(node.shm_dir) == []
        os.truncate(held[0], SEGMENT // 2)  # mapped by the reader (and maybe the node)
        reader.stdin.write("\n")
        reader.stdin.flush()
        line = reader.stdout.readline()
        assert reader.wait(60) == 0, "the reader died"  # -7: a SIGBUS
        second = json.loads(line)
        for got in (first, second):
            assert sum(wrong_bytes(bytes.fromhex(got[rel]), files[rel]) for rel in files) == 0
        assert node.proc is not None and node.proc.poll() is None
