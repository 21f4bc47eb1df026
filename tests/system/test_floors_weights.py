"""Weights and floors of read-through datasets on one node (issue 39): resident memory follows
the weights, a floor holds while another dataset scans or a preload asks for room, and bad
limits are refused in one line with nothing created. Every byte read is compared with the
source."""

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
MIB = 1 << 20

pytestmark = pytest.mark.slow

StartNode = Callable[..., NodeProcess]


@pytest.fixture
def make_node(token_file: Path, tmp_path: Path) -> Iterator[StartNode]:
    with policy_nodes(token_file, tmp_path, BUDGET, SEGMENT) as start:
        yield start


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
