"""Several read-through datasets read at once on one node share its budget without evicting
each other in a loop: from the second shuffled epoch on, each settles at its fair share and
reads 1 - share/size of itself from the source per epoch (issue 39's defect: under `stable`
two datasets at equal holdings took a segment from each other on every miss and read 4-5
times their size per epoch). Every byte is compared with the source."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import NodeProcess
from rt_util import cache_status, policy_nodes, write_files, wrong_bytes

from kspeedfs.client import admin
from pytorch_ext import KSpeedFolder

SEGMENT = 256 << 10
BUDGET = 32 << 20
EPOCHS = 3
MIB = 1 << 20

pytestmark = pytest.mark.slow

StartNode = Callable[..., NodeProcess]


@pytest.fixture
def make_node(token_file: Path, tmp_path: Path) -> Iterator[StartNode]:
    with policy_nodes(token_file, tmp_path, BUDGET, SEGMENT) as start:
        yield start


def fair_shares(sizes: list[int], pool: int) -> list[float]:
    """Max-min shares of `pool` over datasets of `sizes`, computed here on its own."""
    shares = [0.0] * len(sizes)
    left, open_ = float(pool), sorted(range(len(sizes)), key=lambda i: sizes[i])
    while open_:
        even = left / len(open_)
        i = open_[0]
        if sizes[i] <= even:
            shares[i] = sizes[i]
            left -= sizes[i]
            open_.pop(0)
        else:
            for j in open_:
                shares[j] = even
            break
    return shares


def read_at_once(
    node: NodeProcess, tmp_path: Path, sizes_mib: list[int], epochs: int = EPOCHS
) -> tuple[list[list[float]], list[float], list[int]]:
    """Datasets of `sizes_mib` (files of one segment each) read together, interleaved file by
    file, each in its own shuffled order every epoch; per epoch the share of each read from the
    source, each one's expected share of the budget, and the evictions of the last epoch."""
    sets = []
    for k, size in enumerate(sizes_mib):
        src = tmp_path / f"src{k}"
        files = write_files(src, size * MIB // SEGMENT, SEGMENT)
        admin.register_source(node.settings(), str(src), name=f"d{k}")
        ds = KSpeedFolder(src, objname=f"d{k}", nodes=node.address, token=node.token_file)
        sets.append((f"d{k}", ds, files))
    rng = np.random.default_rng(11)
    wrong, per_epoch = 0, []
    evictions: list[int] = []
    for _epoch in range(epochs):
        before = [cache_status(node, name)["source_bytes"] for name, _, _ in sets]
        evicted = [cache_status(node, name)["evictions"] for name, _, _ in sets]
        orders = [list(rng.permutation(len(ds))) for _, ds, _ in sets]
        for step in range(max(len(o) for o in orders)):
            for (_, ds, files), order in zip(sets, orders, strict=True):
                if step < len(order):
                    i = int(order[step])
                    wrong += wrong_bytes(ds[i], files[ds.files[i]])
        per_epoch.append(
            [
                (cache_status(node, name)["source_bytes"] - b) / sum(map(len, files.values()))
                for (name, _, files), b in zip(sets, before, strict=True)
            ]
        )
        evictions = [
            cache_status(node, name)["evictions"] - e
            for (name, _, _), e in zip(sets, evicted, strict=True)
        ]
    assert wrong == 0
    expected = [
        1 - share / (size * MIB)
        for share, size in zip(
            fair_shares([s * MIB for s in sizes_mib], BUDGET), sizes_mib, strict=True
        )
    ]
    return per_epoch, expected, evictions


@pytest.mark.parametrize(
    "sizes_mib",
    [[24, 40], [16, 24, 32], [12, 16, 20, 24]],
    ids=["two", "three", "four"],
)
@pytest.mark.parametrize("policy", ["stable", "plan"])
def test_datasets_read_at_once_settle_at_their_shares(
    make_node: StartNode, tmp_path: Path, sizes_mib: list[int], policy: str
) -> None:
    node = make_node(policy)
    per_epoch, expected, evictions = read_at_once(node, tmp_path, sizes_mib)
    for epoch in per_epoch[1:]:
        for got, want in zip(epoch, expected, strict=True):
            assert got == pytest.approx(want, abs=0.05), (per_epoch, expected)
    # Settled: the last epoch moves (almost) nothing between datasets.
    assert sum(evictions) <= len(sizes_mib), evictions


def test_under_lru_datasets_hold_their_shares_and_evict_only_their_own(
    make_node: StartNode, tmp_path: Path
) -> None:
    """LRU inside a share over shuffled epochs still reads most of a dataset again (its own
    order is the worst one, test_eviction_over_epochs), but it no longer takes another
    dataset's share: resident memory stays at the shares, each within two segments."""
    node = make_node("lru")
    sizes = [24, 40]
    read_at_once(node, tmp_path, sizes, epochs=2)
    shares = fair_shares([s * MIB for s in sizes], BUDGET)
    for k, share in enumerate(shares):
        held = cache_status(node, f"d{k}")["in_memory"] * SEGMENT
        assert abs(held - share) <= 2 * SEGMENT, (k, held, share)
