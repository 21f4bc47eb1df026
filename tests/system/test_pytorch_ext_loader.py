"""The fast path under real DataLoader workers (fork and spawn), two ranks, prefetch, two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from clusterutil import Cluster, running
from conftest import NodeProcess, free_port, kw, preload
from imagefolders import FIXED, make_images
from torch.utils.data import DataLoader
from torchvision import datasets

from kspeedfs.sample import make_sample
from pytorch_ext import ClairvoyantSampler, KSpeedDataset, KSpeedFolder, KSpeedImageFolder

pytestmark = pytest.mark.slow  # DataLoader workers, a second node


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return make_images(tmp_path / "data")


@pytest.fixture
def loaded(node: NodeProcess, images: Path) -> Path:
    preload(node, images.parent, "imgs")
    return images


def batches(loader: DataLoader) -> tuple[torch.Tensor, list[int]]:  # type: ignore[type-arg]
    images, targets = [], []
    for x, y in loader:
        images.append(x)
        targets += y.tolist()
    return torch.cat(images), targets


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_two_workers_give_the_same_epoch(
    node: NodeProcess, loaded: Path, start_method: str
) -> None:
    ref = datasets.ImageFolder(str(loaded), transform=FIXED)
    want, want_targets = batches(DataLoader(ref, batch_size=4))
    ds = KSpeedImageFolder(str(loaded), transform=FIXED, **kw(node))
    got, got_targets = batches(
        DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=start_method)
    )
    assert got_targets == want_targets
    assert torch.equal(got, want)


def test_workers_read_remote_data_with_clairvoyant_prefetch(
    node: NodeProcess, loaded: Path
) -> None:
    ref = datasets.ImageFolder(str(loaded), transform=FIXED)
    ds = KSpeedImageFolder(str(loaded), transform=FIXED, local=False, **kw(node))
    sampler = ClairvoyantSampler(ds, seed=3)
    order = list(sampler)
    got, targets = batches(
        DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    )
    assert targets == [ref.targets[i] for i in order]
    assert torch.equal(got, torch.stack([ref[i][0] for i in order]))


def test_prefetch_serves_every_remote_sample_ahead(node: NodeProcess, loaded: Path) -> None:
    ds = KSpeedFolder(str(loaded), local=False, **kw(node))
    sampler = ClairvoyantSampler(ds, seed=1, depth=2)
    files = list(ds.files)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        before = ds.statistics()
        seen = []
        loader = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=list)
        for batch in loader:
            seen += [bytes(b) for b in batch]
        assert seen == [(loaded / files[i]).read_bytes() for i in sampler]
        after = ds.statistics()
        assert after.get("prefetched", 0) - before.get("prefetched", 0) == len(ds)
        assert after.get("fetched", 0) == before.get("fetched", 0) == 0
    # Off the plan (another order): still correct, read on demand.
    batch = ds.__getitems__([5, 0, 2])
    assert [bytes(b) for b in batch] == [(loaded / files[i]).read_bytes() for i in (5, 0, 2)]
    assert ds.statistics()["fetched"] == 3


def test_npy_batches_through_workers(node: NodeProcess, tmp_path: Path) -> None:
    folder = tmp_path / "features"
    folder.mkdir()
    x = np.random.default_rng(1).standard_normal((300, 50)).astype(np.float32)
    np.save(folder / "x.npy", x)
    preload(node, folder, "feats")
    for local in (None, False):
        ds = KSpeedDataset(str(folder / "x.npy"), batch_size=32, local=local, **kw(node))
        sampler = ds.batch_sampler(seed=4)
        loader = DataLoader(ds, sampler=sampler, batch_size=None, num_workers=2)
        order = [i for b in sampler for i in b]
        got = torch.cat(list(loader))
        assert torch.equal(got, torch.from_numpy(x[order]))
        # Auto-batching calls __getitems__: one read for the batch, then the collate.
        loader = DataLoader(ds, batch_size=50)
        assert torch.equal(torch.cat(list(loader)), torch.from_numpy(x))


RANK_SCRIPT = """
import json, os, sys, hashlib
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms
from pytorch_ext import KSpeedImageFolder

dist.init_process_group("gloo", init_method=sys.argv[2], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
tfm = transforms.Compose([transforms.Resize(48), transforms.CenterCrop(40), transforms.ToTensor()])
ds = KSpeedImageFolder(sys.argv[1], transform=tfm)
sampler = DistributedSampler(ds, shuffle=True, seed=7)
sampler.set_epoch(1)
loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
digests = [hashlib.sha256(x.numpy().tobytes()).hexdigest() for b, _ in loader for x in b]
print(json.dumps({"indices": list(sampler), "digests": digests, "name": ds.dataset_name}))
dist.barrier()
dist.destroy_process_group()
"""


def test_distributed_sampler_two_ranks_cover_the_dataset_once(
    node: NodeProcess, tmp_path: Path
) -> None:
    """Two ranks build the dataset on an unloaded root at once: one active preload, shared."""
    import hashlib

    images = tmp_path / "dist" / "train"
    make_sample(images, classes=2, per_class=5, file_size=4000, bases=2)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(images), init],
            env={**node.env(), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            outs.append((json.loads(out.strip().splitlines()[-1]), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    (a, err0), (b, err1) = outs
    assert a["name"] == b["name"]
    assert "kspeedfs load" not in err1  # progress only on rank 0
    ref = datasets.ImageFolder(str(images), transform=FIXED)
    assert len(ref) == 10
    assert sorted(a["indices"] + b["indices"]) == list(range(10))
    for out in (a, b):
        for i, digest in zip(out["indices"], out["digests"], strict=True):
            assert hashlib.sha256(ref[i][0].numpy().tobytes()).hexdigest() == digest
    # The job's leases ended with the ranks: the actively loaded dataset is gone.
    assert node.request("list")["datasets"] == []


def test_remote_segments_read_from_a_second_node(
    token_file: Path, tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset spread over two nodes: this process maps node 0's segments and reads node 1's
    over TCP; every byte equals the source."""
    # 4 KiB segments: dozens of them, so both nodes hold some, and files span nodes.
    with running(Cluster(token_file, tmp_path, size=2, segment_size="4KiB")) as cluster:
        cluster.preload(images.parent, "spread")
        n0, n1 = cluster.nodes
        held = [cluster.listing(n)["spread"]["held"] for n in (n0, n1)]
        assert held[0] and held[1]
        monkeypatch.setenv("KSPEEDFS_LISTEN", n0.address)
        ds = KSpeedFolder(str(images), nodes=",".join(cluster.addresses), token=str(token_file))
        assert ds._reader.local is not None
        files = list(ds.files)
        got = [bytes(b) for b in ds.__getitems__(list(range(len(files))))]
        assert got == [(images / f).read_bytes() for f in files]
        # Node 0's pieces came from the mapping, node 1's over TCP.
        assert n0.request("status")["stats"]["reads"] == 0
        assert n1.request("status")["stats"]["reads"] >= 1


def test_workers_after_the_source_moved_still_read(node: NodeProcess, loaded: Path) -> None:
    """Reads never touch the source: rename it away and run an epoch through workers."""
    ds = KSpeedImageFolder(str(loaded), transform=FIXED, **kw(node))
    ref = datasets.ImageFolder(str(loaded), transform=FIXED)
    want, _ = batches(DataLoader(ref, batch_size=5))
    moved = loaded.parent.parent / "moved"
    os.rename(loaded.parent, moved)
    got, _ = batches(DataLoader(ds, batch_size=5, num_workers=2))
    assert torch.equal(got, want)
