"""MiniEpochSampler against DistributedSampler: the same epoch, dealt out in mini-epochs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from pytorch_ext import MiniEpochSampler
from pytorch_ext.mini_epoch import MiniEpochPlan


class Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def shares(cls: type, n: int, world: int, epoch: int, **kw: object) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = cls(Sized(n), num_replicas=world, rank=rank, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 7, 100, 1001])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_multiset_as_distributed_sampler(world: int, n: int, drop_last: bool) -> None:
    if drop_last and n < world:
        pytest.skip("DistributedSampler yields nothing")
    for epoch in (0, 3):
        mini = shares(MiniEpochSampler, n, world, epoch, mini_epochs=4, seed=5, drop_last=drop_last)
        dist = shares(DistributedSampler, n, world, epoch, seed=5, drop_last=drop_last)
        assert [len(s) for s in mini] == [len(s) for s in dist]
        assert Counter(i for s in mini for i in s) == Counter(i for s in dist for i in s)
        if not drop_last and n % world == 0:
            # No padding: the shares are disjoint and cover every index once.
            assert sorted(i for s in mini for i in s) == list(range(n))
        if not drop_last:
            assert set().union(*map(set, mini)) == set(range(n))


def test_mini_epochs_are_ranges_of_nearby_samples() -> None:
    n, world, m = 1200, 3, 4
    starts = []
    for rank in range(world):
        s = MiniEpochSampler(Sized(n), mini_epochs=m, num_replicas=world, rank=rank, seed=1)
        order = list(s)
        bounds = s.mini_epoch_bounds()
        assert bounds == [0, 100, 200, 300, 400]
        groups = [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        starts.append([min(g) // 300 for g in groups])
        for g in groups:
            assert max(g) - min(g) < 300  # one quarter of the dataset each
            assert g != sorted(g)  # shuffled inside
    # Every rank visits the same mini-epoch at the same time, in a shuffled order.
    assert starts[0] == starts[1] == starts[2]
    assert sorted(starts[0]) == [0, 1, 2, 3]


def test_seed_and_epoch_decide_the_order() -> None:
    a = MiniEpochSampler(Sized(500), mini_epochs=3, num_replicas=2, rank=1, seed=7)
    b = MiniEpochSampler(Sized(500), mini_epochs=3, num_replicas=2, rank=1, seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    c = MiniEpochSampler(Sized(500), mini_epochs=3, num_replicas=2, rank=1, seed=8)
    assert list(c) != first


def test_no_shuffle_is_sorted_groups_dealt_round_robin() -> None:
    s = MiniEpochSampler(Sized(10), mini_epochs=2, num_replicas=2, rank=1, shuffle=False)
    assert list(s) == [1, 3, 5, 7, 9]


def test_the_plan_is_the_order_and_reaches_the_dataset() -> None:
    class Planned(Sized):
        plan: MiniEpochPlan | None = None

        def set_plan(self, plan: MiniEpochPlan) -> None:
            self.plan = plan

    ds = Planned(321)
    s = MiniEpochSampler(ds, mini_epochs=5, num_replicas=3, rank=2, seed=3)
    s.set_epoch(4)
    assert ds.plan is not None and ds.plan.epoch == 4 and ds.plan.mini_epochs == 5
    assert np.asarray(ds.plan.order()).tolist() == list(s)
    assert ds.plan.next_epoch().order().tolist() != list(s)


def test_bad_mini_epochs_refused() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            MiniEpochSampler(Sized(10), mini_epochs=bad)  # type: ignore[arg-type]
