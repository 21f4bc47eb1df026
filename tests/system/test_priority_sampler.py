"""PrioritySampler: one seeded weighted draw per epoch, dealt to the ranks, told to the dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clusterutil import Cluster, running
from torch.utils.data import DataLoader

from kspeedfs.sample import make_sample
from pytorch_ext import KSpeedFolder, PrioritySampler
from pytorch_ext.priority import PriorityPlan


class Planned:
    """A dataset of `n` items that records the plans a sampler tells it."""

    def __init__(self, n: int):
        self.n = n
        self.plans: list[PriorityPlan] = []

    def __len__(self) -> int:
        return self.n

    def set_plan(self, plan: PriorityPlan) -> None:
        self.plans.append(plan)


# The chi-square critical value at p = 1e-3 for 9 degrees of freedom (10 categories).
CHI2_9_AT_1E3 = 27.877


def chi_square(counts: np.ndarray, weights: np.ndarray) -> float:
    expected = counts.sum() * weights / weights.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_frequencies_follow_the_weights() -> None:
    weights = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 50], dtype=np.float64)
    sampler = PrioritySampler(Planned(10), weights, num_samples=100_000, seed=11)
    counts = np.bincount(np.fromiter(sampler, dtype=np.int64), minlength=10)
    assert counts.sum() == 100_000
    assert chi_square(counts, weights) < CHI2_9_AT_1E3
    # The same counts against uniform weights are far off: the test can tell them apart.
    assert chi_square(counts, np.ones(10)) > 100 * CHI2_9_AT_1E3


def test_ranks_take_disjoint_shares_of_one_reproducible_draw() -> None:
    weights = np.random.default_rng(3).random(101)
    ranks = [
        PrioritySampler(Planned(101), weights, seed=5, num_replicas=3, rank=r) for r in range(3)
    ]
    shares = [list(s) for s in ranks]
    assert [len(s) for s in shares] == [34, 34, 34] == [len(s) for s in ranks]
    whole = ranks[0].plan().draw()
    assert len(whole) == 102
    for r, share in enumerate(shares):
        assert share == whole[r::3].tolist()  # positions r, r+3, ...: disjoint by construction
    again = PrioritySampler(Planned(101), weights, seed=5, num_replicas=3, rank=1)
    assert list(again) == shares[1]  # each rank computes it alone
    again.set_epoch(1)
    assert list(again) != shares[1]


def test_without_replacement_no_index_repeats_and_zero_weights_never_come() -> None:
    weights = np.ones(50)
    weights[::5] = 0
    ranks = [
        PrioritySampler(
            Planned(50), weights, num_samples=40, replacement=False, num_replicas=3, rank=r
        )
        for r in range(3)
    ]
    drawn = [i for s in ranks for i in s]
    assert len(drawn) == 39 == len(set(drawn))  # 40 rounded down to a multiple of 3 ranks
    assert not any(i % 5 == 0 for i in drawn)


def test_set_weights_changes_the_order_and_tells_the_dataset() -> None:
    ds = Planned(20)
    sampler = PrioritySampler(ds, np.ones(20), seed=1)
    first = list(sampler)
    hard = np.full(20, 1e-9)
    hard[7] = 1.0  # one hard example
    sampler.set_weights(hard)
    assert ds.plans[-1] != ds.plans[0]
    assert list(sampler) == ds.plans[-1].order().tolist()
    assert list(sampler).count(7) >= 19 and list(sampler) != first


@pytest.mark.parametrize(
    ("weights", "kwargs", "message"),
    [
        ([1.0, 2.0], {}, "one per sample"),
        ([1.0, -1.0, 1.0], {}, "not negative"),
        ([1.0, float("nan"), 1.0], {}, "finite"),
        ([0.0, 0.0, 0.0], {}, "positive"),
        ([1.0, 0.0, 1.0], {"num_samples": 3, "replacement": False}, "without replacement"),
        ([1.0, 1.0, 1.0], {"num_samples": 0}, "positive int"),
    ],
)
def test_bad_weights_are_one_clear_error(weights: list[float], kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrioritySampler(Planned(3), weights, **kwargs)


@pytest.mark.slow  # two nodes
def test_a_weighted_epoch_on_two_nodes_is_fetched_ahead(token_file: Path, tmp_path: Path) -> None:
    src = tmp_path / "weighted" / "train"
    make_sample(src, classes=3, per_class=8, file_size=6000, bases=3)
    with running(Cluster(token_file, tmp_path, size=2, segment_size="16KiB")) as c:
        c.preload(src.parent, "weighted")
        ds = KSpeedFolder(str(src), nodes=c.addresses, token=str(token_file), local=False)
        files = list(ds.files)
        weights = np.arange(1, len(ds) + 1, dtype=np.float64)
        sampler = PrioritySampler(ds, weights, seed=2, depth=2)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            before = ds.statistics()
            seen = []
            for batch in DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=list):
                seen += [bytes(b) for b in batch]
            assert seen == [(src / files[i]).read_bytes() for i in sampler]
            after = ds.statistics()
            # Counted per distinct file of a batch: a weighted draw repeats files.
            order = list(sampler)
            distinct = sum(len(set(order[k : k + 4])) for k in range(0, len(order), 4))
            assert after.get("prefetched", 0) - before.get("prefetched", 0) == distinct
            assert after.get("fetched", 0) == 0
