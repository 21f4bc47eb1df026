"""The `plan` eviction policy with several ranks: each rank's sampler sends its own share of the
epoch, and the node keeps one plan per rank, with its own cursor. Two ranks read alternately
through the fast path over a read-through dataset twice the budget, on one real node; every
byte compared with the source. And a hostile `reader` field is refused in one line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NodeProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_util import cache_status, policy_nodes, write_files, wrong_bytes

from kspeedfs.client import admin
from kspeedfs.format.contract.readthrough import MAX_READER, PlanReq
from kspeedfs.format.errors import InvalidArgument
from pytorch_ext import ClairvoyantSampler, KSpeedFolder, PrioritySampler
from pytorch_ext.folder import plan_reader
from pytorch_ext.prefetch import EpochPlan

SEGMENT = 256 << 10
BUDGET = 32 << 20
FILES = 256  # of one segment each: 64 MiB, twice the budget
EPOCHS = 3
RANKS = 2

RankSampler = Callable[[KSpeedFolder, int], ClairvoyantSampler]


def shuffle(ds: KSpeedFolder, rank: int) -> ClairvoyantSampler:
    return ClairvoyantSampler(ds, num_replicas=RANKS, rank=rank, seed=7, depth=2)


def draws(ds: KSpeedFolder, rank: int) -> ClairvoyantSampler:
    """Even weights, drawn with replacement: some samples come twice in an epoch, some not."""
    return PrioritySampler(ds, np.ones(len(ds)), seed=7, num_replicas=RANKS, rank=rank, depth=2)


@pytest.fixture
def start_node(token_file: Path, tmp_path: Path) -> Iterator[Callable[[str], NodeProcess]]:
    """Nodes with a 32 MiB budget, 256 KiB segments and an eviction policy; removed after."""
    with policy_nodes(token_file, tmp_path, BUDGET, SEGMENT) as start:
        yield start


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("src") / "big"
    return root, write_files(root, FILES, SEGMENT)


def ranked_epochs(
    node: NodeProcess, src: Path, files: dict[str, bytes], name: str, sampler: RankSampler
) -> list[float]:
    """EPOCHS epochs of two ranks, each its own dataset, sampler and DataLoader, reading a
    batch in turn; per epoch, the share of the dataset read from the source."""
    admin.register_source(node.settings(), str(src), name=name)
    ranks = [
        KSpeedFolder(src, objname=name, nodes=node.address, token=node.token_file)
        for _ in range(RANKS)
    ]
    samplers = [sampler(ds, rank) for rank, ds in enumerate(ranks)]
    loaders = [
        torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, collate_fn=list)
        for ds, s in zip(ranks, samplers, strict=True)
    ]
    total = sum(len(b) for b in files.values())
    wrong, shares = 0, []
    for epoch in range(EPOCHS):
        before = int(cache_status(node, name)["source_bytes"])
        for s in samplers:
            s.set_epoch(epoch)
        orders = [list(s) for s in samplers]
        got: list[list[Any]] = [[] for _ in range(RANKS)]
        for batches in zip(*loaders, strict=True):
            for rank, batch in enumerate(batches):
                got[rank].extend(batch)
        for ds, order, samples in zip(ranks, orders, got, strict=True):
            for i, data in zip(order, samples, strict=True):
                wrong += wrong_bytes(data, files[ds.files[int(i)]])
        shares.append((int(cache_status(node, name)["source_bytes"]) - before) / total)
    assert wrong == 0
    return shares


def test_two_ranks_each_have_their_plan_and_the_node_keeps_what_both_come_back_to(
    start_node: Callable[[str], NodeProcess], source: tuple[Path, dict[str, bytes]]
) -> None:
    """Over a shuffle no policy beats the budget's share, and the plans must not thrash; over
    draws, where samples repeat, both ranks' plans together keep what comes back, so less is
    read from the source than `stable` reads (with only the last rank's plan, as the node
    kept before, 0.45-0.49 against stable's 0.48-0.51 here; with both, 0.36-0.42)."""
    src, files = source
    node = start_node("plan")
    planned = {"shuffled": ranked_epochs(node, src, files, "shuffled", shuffle)}
    plans = cache_status(node, "shuffled")["plan"]
    assert sorted(plans) == ["0/2", "1/2"], plans  # one plan per rank, not the last one sent
    assert all(cursor > 0 for cursor, _uses in plans.values()), plans  # each one followed
    node.request("unload", name="shuffled")
    planned["drawn"] = ranked_epochs(node, src, files, "drawn", draws)
    node.stop()
    node = start_node("stable")
    stable = {"shuffled": ranked_epochs(node, src, files, "shuffled", shuffle)}
    node.request("unload", name="shuffled")
    stable["drawn"] = ranked_epochs(node, src, files, "drawn", draws)
    after_first = {
        policy: {kind: max(shares[1:]) for kind, shares in runs.items()}
        for policy, runs in (("plan", planned), ("stable", stable))
    }
    # No worse than stable, give or take five segments of 256 (when the ranks' misses land).
    assert after_first["plan"]["shuffled"] <= after_first["stable"]["shuffled"] + 0.02, after_first
    assert after_first["plan"]["shuffled"] <= 0.6, after_first
    assert after_first["plan"]["drawn"] < min(stable["drawn"][1:]), (planned, stable)


def test_a_rank_names_its_share_and_a_whole_dataset_sampler_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = EpochPlan(
        length=10, num_replicas=8, rank=2, shuffle=True, seed=0, drop_last=False, epoch=0, depth=2
    )
    monkeypatch.setenv("RANK", "5")
    assert plan_reader(plan) == "2/8"  # the sampler's own rank, not the process's
    whole = EpochPlan(
        length=10, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=False, epoch=0, depth=2
    )
    assert plan_reader(whole) == "5/1"
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert plan_reader(whole) == "0/1"


PLAN_FIELDS = {"plan": "p", "name": "big", "segments": [0], "total": 1}
NOT_A_STRING = st.none() | st.booleans() | st.integers() | st.lists(st.text(max_size=3))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(min_size=MAX_READER + 1, max_size=200) | NOT_A_STRING)
def test_a_hostile_reader_is_one_line_invalid_argument(reader: Any) -> None:
    with pytest.raises(InvalidArgument) as refused:
        PlanReq.from_wire({"op": "plan", **PLAN_FIELDS, "reader": reader})
    message = str(refused.value)
    assert message.startswith("op plan: reader") and "\n" not in message, message


def test_a_hostile_reader_sent_to_a_node_is_refused_and_changes_nothing(
    start_node: Callable[[str], NodeProcess], source: tuple[Path, dict[str, bytes]]
) -> None:
    src, _files = source
    node = start_node("plan")
    admin.register_source(node.settings(), str(src), name="big")
    for reader in ("r" * (MAX_READER + 1), 3, "a\nb"):
        with pytest.raises(InvalidArgument, match="^op plan: reader"):
            node.request("plan", **PLAN_FIELDS, reader=reader)
    assert cache_status(node, "big")["plan"] is None
    assert node.request("plan", **PLAN_FIELDS)["complete"]
    assert cache_status(node, "big")["plan"] == {"": [0, 1]}  # an old reader: no field
