"""A 1,000,000-line meta file under 8 DataLoader workers: the mapped index against a list.

Memory is each worker's USS (pages only it holds) after its share of random samples, minus its
USS when it started, beyond that of a worker doing the same decoding and batching of one image
held in memory (the floor: decoder and collate pages every worker pays). A list of parsed lines is copied page by page into every worker that
touches it (reference counts are writes); the index is mapped, so a worker adds nothing for it.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from conftest import NodeProcess, run_cli
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image, read_file

from kspeedfs.sample import make_sample
from pytorch_ext import KSpeedMetaDataset

pytestmark = pytest.mark.slow  # 1,000,000 meta lines under 8 DataLoader workers

LINES = 1_000_000
WORKERS = 8
PER_WORKER = 4000
MiB = 1 << 20


class ListMeta(Dataset[tuple[torch.Tensor, int]]):
    """The usual meta dataset: every line parsed into a Python list, in every process."""

    def __init__(self, root: Path, meta: str):
        self.root = root
        self.samples: list[tuple[str, int]] = []
        with open(root / meta) as f:
            for line in f:
                path, target = line.split()
                self.samples.append((path, int(target)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[i]
        data = read_file(str(self.root / path))
        return decode_image(data, mode=ImageReadMode.RGB), target


class SameImage(Dataset[tuple[torch.Tensor, int]]):
    """The baseline: the same decoding and batching, of one image held in memory, no meta."""

    def __init__(self, image: Path):
        self.data = read_file(str(image))

    def __len__(self) -> int:
        return LINES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return decode_image(self.data, mode=ImageReadMode.RGB), i % 1000


def worker_growth(ds: Dataset[Any], indices: list[int]) -> list[int]:
    """Per worker: USS after serving its batches minus USS when it started."""
    ctx = multiprocessing.get_context("fork")
    started = ctx.Array("q", WORKERS)
    pids = ctx.Array("q", WORKERS)

    def at_start(worker_id: int) -> None:
        me = psutil.Process()
        pids[worker_id] = me.pid
        started[worker_id] = me.memory_full_info().uss

    loader = DataLoader(
        ds,
        batch_size=100,
        sampler=indices,
        num_workers=WORKERS,
        worker_init_fn=at_start,
        persistent_workers=True,
        multiprocessing_context=ctx,
    )
    served = 0
    for images, _targets in loader:
        served += len(images)
    assert served == len(indices)
    # The workers stay up (persistent) until the loader goes.
    growth = [psutil.Process(pids[w]).memory_full_info().uss - started[w] for w in range(WORKERS)]
    del loader
    return growth


def test_eight_workers_over_a_million_lines(
    node: NodeProcess, tmp_path: Path, record_property: Any
) -> None:
    root = tmp_path / "million"
    make_sample(root / "img", classes=4, per_class=2, file_size=2000, bases=2)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.JPEG"))
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(files), LINES)
    with open(root / "train.txt", "w") as f:
        f.writelines(f"{files[k]} {i % 1000}\n" for i, k in enumerate(picks.tolist()))
    done = run_cli(
        "preload", str(root), "--name", "million", "--meta", "train.txt", "-q", env=node.env()
    )
    assert done.returncode == 0, done.stderr

    kspeed = KSpeedMetaDataset(
        root, "train.txt", decode="tensor", nodes=node.address, token=str(node.token_file)
    )
    indices = rng.choice(LINES, WORKERS * PER_WORKER, replace=False).tolist()
    baseline = worker_growth(SameImage(root / files[0]), indices)
    # Measured before the list exists here: forked workers would inherit it (and the
    # collector's passes over it would copy its pages into them).
    kspeed_growth = worker_growth(kspeed, indices)
    listed = ListMeta(root, "train.txt")
    assert len(kspeed) == len(listed) == LINES
    for i in (0, 1, 777_777, LINES - 1):
        a, ta = kspeed[i]
        b, tb = listed[i]
        assert ta == tb and torch.equal(a, b)
    list_growth = worker_growth(listed, indices)
    floor = float(np.mean(baseline))
    over = [g - floor for g in kspeed_growth]
    list_over = [g - floor for g in list_growth]
    report = (
        f"USS growth per worker over {LINES} lines, {PER_WORKER} random samples each, beyond "
        f"a worker decoding one in-memory image ({floor / MiB:.2f} MiB): KSpeedMetaDataset "
        f"max {max(over) / MiB:+.2f} MiB, list-based max {max(list_over) / MiB:+.2f} MiB "
        f"(min {min(list_over) / MiB:+.2f})"
    )
    record_property("memory", report)
    print(report, file=sys.stderr)
    assert max(over) < 5 * MiB, report
    # The measurement sees what the list costs (else the bound above would say nothing).
    assert min(list_over) > 5 * MiB, report
