"""Two ranks of torch.distributed (gloo on 127.0.0.1) over the fast path, no mount: both attach
to the same meta dataset (the first loads it actively), and MiniEpochSampler deals the epochs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import NodeProcess, free_port
from torch.utils.data import DataLoader, DistributedSampler

from kspeedfs.client import admin
from kspeedfs.format.config import load_settings
from kspeedfs.sample import make_sample

pytestmark = pytest.mark.slow  # two torch.distributed ranks

WORLD = 2
LINES = 203  # odd: the last rank's share is padded, as DistributedSampler does
EPOCHS = 2


def rank_main(rank: int, port: int, root: str, node: str, token: str, out: str) -> None:
    from pytorch_ext import KSpeedMetaDataset, MiniEpochSampler

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        ds = KSpeedMetaDataset(root, "train.txt", decode="tensor", nodes=node, token=token)
        sampler = MiniEpochSampler(ds, mini_epochs=3, seed=11)
        loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2)
        seen: list[list[int]] = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            targets: list[int] = []
            for images, batch_targets in loader:
                assert images.dtype == torch.uint8 and images.shape[1] == 3
                targets.extend(int(t) for t in batch_targets)
            assert targets == list(sampler)  # target i is on line i: what it yielded, in order
            seen.append(targets)
        everyone: list[object] = [None] * WORLD
        dist.all_gather_object(everyone, seen)
        if rank == 0:
            Path(out).write_text(json.dumps(everyone))
        dist.barrier()  # both ranks hold their lease until both are done
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_gloo(node: NodeProcess, tmp_path: Path) -> None:
    root = tmp_path / "ranks"
    make_sample(root / "img", classes=2, per_class=2, file_size=2000, bases=2)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.JPEG"))
    (root / "train.txt").write_text("".join(f"{files[i % 4]} {i}\n" for i in range(LINES)))
    out = tmp_path / "seen.json"
    mp.spawn(
        rank_main,
        args=(free_port(), str(root), node.address, str(node.token_file), str(out)),
        nprocs=WORLD,
        join=True,
    )
    seen = json.loads(out.read_text())
    for epoch in range(EPOCHS):
        shares = [seen[rank][epoch] for rank in range(WORLD)]
        reference = []
        for rank in range(WORLD):
            s: DistributedSampler[int] = DistributedSampler(
                range(LINES),  # type: ignore[arg-type]
                num_replicas=WORLD,
                rank=rank,
                seed=11,
            )
            s.set_epoch(epoch)
            reference.extend(s)
        assert Counter(i for share in shares for i in share) == Counter(reference)
        assert set(shares[0]) | set(shares[1]) == set(range(LINES))
        assert len(set(shares[0]) & set(shares[1])) <= 1  # only the one padded index repeats
    assert seen[0][0] != seen[0][1]  # a new order each epoch
    # The ranks loaded it actively with a lease: gone once both left.
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    with admin.connect(settings) as client:
        assert [d["name"] for d in client.request("list")["datasets"]] == []
