"""The eviction policies over shuffled epochs, and caps per dataset, on real nodes with small
budgets: a read-through dataset twice the budget, read three epochs in shuffled order through
the fast path; every byte compared with the source."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NodeProcess, run_cli
from rt_util import (
    cache_status,
    mount_source,
    policy_nodes,
    read_uncached,
    write_files,
    wrong_bytes,
)

from kspeedfs.client import admin
from kspeedfs.format.errors import NoSpace
from pytorch_ext import ClairvoyantSampler, KSpeedFolder, PrioritySampler

SEGMENT = 256 << 10
BUDGET = 32 << 20
FILES = 256  # of one segment each: 64 MiB, twice the budget
EPOCHS = 3

StartNode = Callable[..., NodeProcess]


@pytest.fixture
def make_node(token_file: Path, tmp_path: Path) -> Iterator[StartNode]:
    """Nodes with a 32 MiB budget, 256 KiB segments and a policy; stopped and removed after."""
    with policy_nodes(token_file, tmp_path, BUDGET, SEGMENT) as start:
        yield start


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("src") / "big"
    return root, write_files(root, FILES, SEGMENT)


def register(node: NodeProcess, src: Path, name: str, **caps: int) -> None:
    admin.register_source(node.settings(), str(src), name=name, **caps)


def open_dataset(node: NodeProcess, src: Path, name: str) -> KSpeedFolder:
    return KSpeedFolder(src, objname=name, nodes=node.address, token=node.token_file)


def source_bytes(node: NodeProcess, name: str) -> int:
    return int(cache_status(node, name)["source_bytes"])


MakeSampler = Callable[[KSpeedFolder], ClairvoyantSampler]


def clairvoyant(ds: KSpeedFolder) -> ClairvoyantSampler:
    return ClairvoyantSampler(ds, seed=7, depth=2)


def priority(ds: KSpeedFolder) -> ClairvoyantSampler:
    """Even weights, drawn with replacement: some samples come twice in an epoch, some not."""
    return PrioritySampler(ds, np.ones(len(ds)), seed=7, depth=2)


def shuffled_epochs(
    node: NodeProcess,
    src: Path,
    files: dict[str, bytes],
    name: str,
    sampler: MakeSampler | None = None,
    epochs: int = EPOCHS,
) -> list[float]:
    """`epochs` shuffled passes over the dataset through the fast path; per epoch, the share of
    the dataset read from the source. With a `sampler`, a DataLoader over it (its prefetcher
    sends the plan to the node); else a seeded shuffle read file by file."""
    ds = open_dataset(node, src, name)
    total = sum(len(b) for b in files.values())
    wrong, shares = 0, []
    for epoch in range(epochs):
        before = source_bytes(node, name)
        if sampler is not None:
            order_sampler = sampler(ds)
            order_sampler.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(
                ds, batch_size=8, sampler=order_sampler, collate_fn=list
            )
            indices = list(order_sampler)
            got = [sample for batch in loader for sample in batch]
        else:
            indices = list(np.random.default_rng(epoch).permutation(len(ds)))
            got = [ds[int(i)] for i in indices]
        for i, data in zip(indices, got, strict=True):
            wrong += wrong_bytes(data, files[ds.files[int(i)]])
        shares.append((source_bytes(node, name) - before) / total)
    assert wrong == 0
    return shares


def test_stable_keeps_half_of_a_dataset_twice_the_budget_and_lru_thrashes(
    make_node: StartNode, source: tuple[Path, dict[str, bytes]]
) -> None:
    src, files = source
    after_first: dict[str, float] = {}
    for policy in ("stable", "lru"):
        node = make_node(policy)
        register(node, src, "big")
        shares = shuffled_epochs(node, src, files, "big")
        assert shares[0] == pytest.approx(1.0, abs=0.01)  # every byte once, none twice
        after_first[policy] = max(shares[1:])
        node.stop()
    assert after_first["stable"] <= 0.6, after_first
    assert after_first["lru"] > after_first["stable"], after_first


def test_the_plan_keeps_a_shuffle_stable_and_reads_less_where_samples_repeat(
    make_node: StartNode, source: tuple[Path, dict[str, bytes]]
) -> None:
    """A shuffle uses every segment once an epoch: no policy keeps more than the budget's
    share, and the plan must not thrash. A weighted draw repeats some samples and skips
    others: the plan keeps the ones coming back."""
    src, files = source
    node = make_node("plan")
    register(node, src, "big")
    shuffled = shuffled_epochs(node, src, files, "big", clairvoyant)
    assert cache_status(node, "big")["plan"] is not None  # the prefetcher sent it
    node.request("unload", name="big")
    register(node, src, "drawn")
    planned = shuffled_epochs(node, src, files, "drawn", priority)
    node.stop()
    node = make_node("stable")
    register(node, src, "drawn")
    stable = shuffled_epochs(node, src, files, "drawn", priority)
    assert max(shuffled[1:]) <= 0.6, shuffled
    assert max(planned[1:]) <= 0.5, planned
    assert max(planned[1:]) < min(stable[1:]), (planned, stable)


def test_traffic_on_one_dataset_never_evicts_a_capped_one(
    make_node: StartNode, source: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """Under LRU, the policy that would take anything: an uncapped dataset twice the budget
    leaves a capped one whole, and a capped one never holds more than its cap."""
    src, files = source
    small_src = tmp_path / "small"
    small_files = write_files(small_src, 16, SEGMENT)  # 4 MiB
    node = make_node("lru")
    register(node, small_src, "small", max_memory=8 << 20)
    small = open_dataset(node, small_src, "small")
    for i in range(len(small)):
        assert wrong_bytes(small[i], small_files[small.files[i]]) == 0
    held = cache_status(node, "small")
    assert held["in_memory"] == 16 and held["max_memory"] == 8 << 20, held
    register(node, src, "big")
    shuffled_epochs(node, src, files, "big", epochs=1)
    big = cache_status(node, "big")
    assert big["evictions"] > 0, big  # the budget was short: it made room in its own data
    after = cache_status(node, "small")
    assert after["in_memory"] == 16 and after["evictions"] == 0, after
    node.request("unload", name="big")
    register(node, src, "capped", max_memory=8 << 20)
    shuffled_epochs(node, src, files, "capped", epochs=1)
    capped = cache_status(node, "capped")
    assert 0 < capped["in_memory"] * SEGMENT <= 8 << 20 and capped["evictions"] > 0, capped
    assert cache_status(node, "small")["in_memory"] == 16


def test_a_cap_larger_than_the_free_budget_is_refused_in_one_line(
    make_node: StartNode, source: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    src, _files = source
    node = make_node("stable")
    register(node, src, "capped", max_memory=24 << 20)
    with pytest.raises(NoSpace, match="max-memory 16.0 MiB for 'other' is more than"):
        register(node, src, "other", max_memory=16 << 20)
    assert "other" not in node.request("status")["cache"]["datasets"]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = run_cli(
        "mount",
        str(mnt),
        "--source",
        str(src),
        "--name",
        "third",
        "--max-memory",
        "1GiB",
        env=node.env(),
    )
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--max-memory 1.0 GiB for 'third' is more than" in done.stderr
    assert not os.path.ismount(mnt)


@pytest.mark.fuse
def test_misses_not_kept_read_equal_through_the_mount(
    make_node: StartNode, source: tuple[Path, dict[str, bytes]], tmp_path: Path, mounts: list[Any]
) -> None:
    src, files = source
    node = make_node("stable")
    m = mount_source(node, tmp_path, mounts, src, "--name", "big")
    rng = np.random.default_rng(3)
    names = sorted(files)
    wrong = 0
    for _epoch in range(2):
        for i in rng.permutation(len(names)):
            rel = names[int(i)]
            wrong += wrong_bytes(read_uncached(m.mountpoint / rel), files[rel])
    assert wrong == 0
    st = cache_status(node, "big")
    assert st["bypassed"] > 0 and st["evictions"] == 0, st
