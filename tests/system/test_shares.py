"""Several read-through datasets on one node's budget (issue 39), every byte read compared
with the source:
- read at once, they settle at their max-min shares and stay there: from the second shuffled
  epoch on each reads 1 - share/size of itself from the source (the defect: under `stable` two
  datasets at equal holdings took a segment from each other on nearly every miss);
- resident memory follows the weights, and a floor holds while another dataset scans or a
  preload asks for room;
- bad limits are refused in one line with nothing created."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import NodeProcess, run_cli
from rt_util import cache_status, policy_nodes, write_files, wrong_bytes

from kspeedfs.client import admin
from kspeedfs.format.errors import InvalidArgument, NoSpace
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


class Reader:
    """One read-through dataset of `mib` MiB (files of one segment) and its fast-path reader."""

    def __init__(self, node: NodeProcess, root: Path, name: str, mib: int, **limits: int):
        self.node, self.name = node, name
        src = root / name
        self.files = write_files(src, mib * MIB // SEGMENT, SEGMENT)
        self.size = sum(map(len, self.files.values()))
        admin.register_source(node.settings(), str(src), name=name, **limits)
        self.ds = KSpeedFolder(src, objname=name, nodes=node.address, token=node.token_file)
        self.wrong = 0

    def read(self, i: int) -> None:
        self.wrong += wrong_bytes(self.ds[i], self.files[self.ds.files[i]])

    def status(self) -> dict[str, int]:
        return cache_status(self.node, self.name)


def epochs_at_once(readers: list[Reader], epochs: int, seed: int = 5) -> list[list[float]]:
    """Shuffled epochs of every reader, interleaved file by file; per epoch the share of each
    read from the source."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(epochs):
        before = [r.status()["source_bytes"] for r in readers]
        orders = [list(rng.permutation(len(r.ds))) for r in readers]
        while any(orders):
            for r, order in zip(readers, orders, strict=True):
                if order:
                    r.read(int(order.pop()))
        out.append(
            [
                (r.status()["source_bytes"] - b) / r.size
                for r, b in zip(readers, before, strict=True)
            ]
        )
    assert sum(r.wrong for r in readers) == 0
    return out


def test_weights_three_to_one_hold_memory_three_to_one(
    make_node: StartNode, tmp_path: Path
) -> None:
    """Two datasets each twice the budget, weights 3:1: resident 3:1 within 5% after two
    epochs, each reading 1 - share/size of itself from the source per epoch."""
    node = make_node("stable")
    heavy = Reader(node, tmp_path, "heavy", 64, weight=3)
    light = Reader(node, tmp_path, "light", 64)
    per_epoch = epochs_at_once([heavy, light], 3)
    held = [r.status()["resident_bytes"] for r in (heavy, light)]
    assert held[0] / held[1] == pytest.approx(3.0, rel=0.05), held
    shares = [r.status()["share"] for r in (heavy, light)]
    assert shares[0] / shares[1] == pytest.approx(3.0, rel=0.01), shares
    for epoch in per_epoch[1:]:
        for got, r, share in zip(epoch, (heavy, light), shares, strict=True):
            assert got == pytest.approx(1 - share / r.size, abs=0.05), (per_epoch, shares)


def test_a_floor_holds_while_another_dataset_scans_and_a_preload_asks(
    make_node: StartNode, tmp_path: Path
) -> None:
    """Job A's dataset fits its floor; another tenant scans a dataset 8x the budget under
    `lru` (the policy that takes from anyone it may), then a preload wants more than is
    free: A keeps reading less than 1% of itself from the source per epoch, and the preload
    is refused rather than taking A's floor."""
    node = make_node("lru")
    a = Reader(node, tmp_path, "a", 12, min_memory=12 * MIB)
    epochs_at_once([a], 1)  # A's working set is in
    scan = Reader(node, tmp_path, "scan", 256)
    rng = np.random.default_rng(1)
    for _ in range(2):
        order = list(rng.permutation(len(a.ds)))
        for i in rng.permutation(len(scan.ds)):
            scan.read(int(i))
            if order and i % 16 == 0:  # A reads a file for every 16 the scan reads
                a.read(int(order.pop()))
        before = a.status()["source_bytes"]
        for i in order:
            a.read(int(i))
        assert a.status()["resident_bytes"] >= 12 * MIB - SEGMENT, a.status()
    assert scan.wrong == 0 and a.wrong == 0
    assert a.status()["source_bytes"] - before <= 0.01 * a.size
    assert scan.status()["evictions"] > 0  # the scan made room in its own data
    # A preload of 24 MiB fits only by taking A's floor: refused, A whole.
    pre = tmp_path / "pre"
    write_files(pre, 24 * MIB // SEGMENT, SEGMENT)
    with pytest.raises(NoSpace, match=r"\(held by (\w+ [\d.]+ \w+, )*a 12\.0 MiB"):
        admin.preload(node.settings(), str(pre), "pre", show_progress=False)
    assert a.status()["resident_bytes"] >= 12 * MIB - SEGMENT
    assert "pre" not in node.request("status")["cache"]["datasets"]


def test_bad_limits_are_refused_in_one_line_and_create_nothing(
    make_node: StartNode, tmp_path: Path
) -> None:
    node = make_node("stable")
    src = tmp_path / "src"
    write_files(src, 8, SEGMENT)
    admin.register_source(node.settings(), str(src), name="held", min_memory=20 * MIB)
    cases: list[tuple[dict[str, int], type[Exception], str]] = [
        ({"weight": 0}, InvalidArgument, "weight must be at least 1"),
        ({"weight": -2}, InvalidArgument, "weight must be at least 1"),
        ({"min_memory": 64 * MIB}, NoSpace, "--min-memory 64.0 MiB for 'bad' is more than"),
        # Floors together over the budget: 20 MiB is held by "held" already.
        ({"min_memory": 16 * MIB}, NoSpace, "--min-memory 16.0 MiB for 'bad' is more than"),
        (
            {"min_memory": 8 * MIB, "max_memory": 4 * MIB},
            InvalidArgument,
            "--min-memory 8.0 MiB for 'bad' is more than its --max-memory 4.0 MiB",
        ),
    ]
    for limits, error, message in cases:
        with pytest.raises(error, match=message):
            admin.register_source(node.settings(), str(src), name="bad", **limits)
        assert "bad" not in node.request("status")["cache"]["datasets"]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = run_cli(
        "mount", str(mnt), "--source", str(src), "--name", "bad", "--weight", "0", env=node.env()
    )
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "weight must be at least 1" in done.stderr
    done = run_cli("mount", str(mnt), "--weight", "2", env=node.env())
    assert done.returncode != 0 and "go with --source" in done.stderr, done.stderr
