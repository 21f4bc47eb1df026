"""A worker asked about an instance another worker already serves waits to hear of it."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
from conftest import NodeProcess, run_cli

from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import load_settings
from kspeedfs.format.contract.node import DatasetListing
from kspeedfs.fuse.datasets import SLOT_SHIFT
from kspeedfs.fuse.filesystem import KSpeedFS
from kspeedfs.fuse.kernel import FuseError

pytestmark = pytest.mark.slow  # several mount workers


class QuietSupervisor:
    def ask_refresh(self, force: bool, wait: float) -> None:
        pass

    def wait_invalidations(self, timeout: float) -> None:
        pass


def test_a_slot_not_heard_of_yet_is_waited_for_and_a_dropped_one_is_stale(
    node: NodeProcess, tree: Path
) -> None:
    done = run_cli("preload", str(tree), "--name", "ds", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    reader = ClusterReader(settings, node.address)
    fs = KSpeedFS(reader, QuietSupervisor())
    info = DatasetListing.from_wire(node.request("list")).ready()["ds"]
    try:
        # Another worker handed out inodes of slot 1; this one opens it a moment later.
        late = threading.Timer(0.3, fs.add, args=(1, "ds", info.uuid, info, None))
        late.start()
        mounted, idx = fs._locate((1 << SLOT_SHIFT) | 1)
        assert (mounted.slot, mounted.name, idx) == (1, "ds", 0)
        late.join()
        fs.drop(1)  # unloaded: its inodes are stale at once
        with pytest.raises(FuseError) as e:
            fs._locate((1 << SLOT_SHIFT) | 1)
        assert e.value.errno == errno.ESTALE
    finally:
        reader.close()
