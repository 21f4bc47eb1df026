"""Decoded variants over a 3-node cluster: each node decodes only the images it holds
(replicas included), and the variant's pixels equal Resize(N)(pil_loader(path))."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clusterutil import Cluster, running
from conftest import run_cli
from decoded_images import _noise
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import Resize

from kspeedfs.format import decoded as fmt
from kspeedfs.system.local_dataset import LocalDataset

pytestmark = pytest.mark.slow  # three nodes


def test_each_node_decodes_what_it_holds(token_file: Path, tmp_path: Path) -> None:
    src = tmp_path / "images"
    for i in range(24):
        folder = src / f"c{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        _noise(120 + i, 90, "RGB", i).save(folder / f"{i:02d}.jpg", "JPEG", quality=95)
    with running(Cluster(token_file, tmp_path, segment_size="64KiB")) as c:
        r = run_cli(
            "preload",
            str(src),
            "--name",
            "imgs2",
            "--replicas",
            "2",
            "--decoded",
            "48",
            "-q",
            env=c.env(),
        )
        assert r.returncode == 0, r.stderr
        decoded_here = {}
        for node in c.nodes:
            folder = node.shm_dir / "datasets" / "imgs2"
            ds = LocalDataset(folder)
            m = ds.manifest
            variant = fmt.DecodedVariant(folder / fmt.variant_dir(48), ds.uuid)
            held = [i for i in m.iter_files() if ds.holds_file(i)]
            ready = [i for i in m.iter_files() if variant.state(i) == fmt.READY]
            assert ready == held  # exactly the files it holds, nothing else
            decoded_here[node.address] = len(ready)
            for i in ready:
                data, h, w = variant.pixels(i)
                got = np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3)
                want = np.asarray(Resize(48)(pil_loader(str(src / m.path(i).decode()))))
                assert np.array_equal(got, want)
        assert sum(1 for n in decoded_here.values() if n) >= 2  # spread over the nodes
        listing = run_cli("ls", env=c.env())
        assert "48: 100%" in listing.stdout
