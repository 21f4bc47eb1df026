"""MiniEpochSampler: DistributedSampler's epoch, dealt out in mini-epochs of nearby samples.

ModelTC's rank_dataset splits each rank's share of a meta file into mini-epochs so that a rank
holds 1/(world_size x mini_epochs) of the meta at a time, and rebuilds its loader for each.
Here the meta is mapped once per node, so nothing has to be rebuilt: the sampler keeps one
epoch per `set_epoch`, with the same index multiset as DistributedSampler (same seed, same
padding), and orders it in `mini_epochs` groups. Group g holds a contiguous range of the
sorted epoch (nearby lines of the meta, so nearby files and segments), shuffled inside and
dealt round-robin to the ranks; the groups come in a seeded order. Only one group's files
need to be resident (a read-through dataset's working set) and prefetched at a time, and
the sampler hands its plan to the dataset, as ClairvoyantSampler does, for the prefetch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from .prefetch import ClairvoyantSampler, EpochPlan


def epoch_indices(
    length: int, num_replicas: int, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> tuple[np.ndarray, torch.Generator]:
    """DistributedSampler's whole padded (or cut) epoch before it is dealt to the ranks, and
    the generator it used (carried on for the mini-epochs' shuffles)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    if shuffle:
        indices = torch.randperm(length, generator=g).numpy()
    else:
        indices = np.arange(length, dtype=np.int64)
    if drop_last and length % num_replicas:
        num_samples = math.ceil((length - num_replicas) / num_replicas)
    else:
        num_samples = math.ceil(length / num_replicas)
    total = num_samples * num_replicas
    if not drop_last and total > length:
        indices = np.resize(indices, total)  # repeats from the start, as DistributedSampler
    return indices[:total].astype(np.int64), g


def group_sizes(num_samples: int, mini_epochs: int) -> list[int]:
    """Samples per rank in each mini-epoch: as equal as can be, the larger ones first."""
    base, extra = divmod(num_samples, mini_epochs)
    return [base + (1 if k < extra else 0) for k in range(mini_epochs)]


@dataclasses.dataclass(frozen=True)
class MiniEpochPlan(EpochPlan):
    """An EpochPlan whose order is the mini-epoch order (what MiniEpochSampler yields)."""

    mini_epochs: int = 1

    def groups(self) -> list[np.ndarray]:
        """This rank's samples in each mini-epoch, in the order they come."""
        everything, g = epoch_indices(
            self.length, self.num_replicas, self.shuffle, self.seed, self.epoch, self.drop_last
        )
        ordered = np.sort(everything, kind="stable")
        w = self.num_replicas
        bounds = np.cumsum([0] + group_sizes(len(ordered) // w, self.mini_epochs)) * w
        if self.shuffle:
            visit = torch.randperm(self.mini_epochs, generator=g).tolist()
        else:
            visit = list(range(self.mini_epochs))
        out = [np.empty(0, dtype=np.int64)] * self.mini_epochs
        for k in range(self.mini_epochs):  # every group draws its shuffle, in group order
            group = ordered[bounds[k] : bounds[k + 1]]
            if self.shuffle:
                group = group[torch.randperm(len(group), generator=g).numpy()]
            out[k] = group[self.rank :: w]
        return [out[k] for k in visit]

    def order(self) -> np.ndarray:  # type: ignore[override]
        groups = self.groups()
        return np.concatenate(groups) if groups else np.empty(0, dtype=np.int64)


class MiniEpochSampler(ClairvoyantSampler):
    """A DistributedSampler (num_replicas, rank, shuffle, seed, drop_last, set_epoch) that
    orders each rank's share in `mini_epochs` groups of nearby samples; one DataLoader serves
    the whole run. `mini_epoch_bounds()` says where each group starts in this rank's order."""

    def __init__(
        self,
        dataset: Any,
        mini_epochs: int = 1,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        depth: int = 4,
    ):
        if isinstance(mini_epochs, bool) or not isinstance(mini_epochs, int) or mini_epochs < 1:
            raise ValueError(f"mini_epochs must be a positive int, not {mini_epochs!r}")
        self.mini_epochs = mini_epochs
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last, depth)

    def plan(self) -> MiniEpochPlan:
        base = super().plan()
        return MiniEpochPlan(**dataclasses.asdict(base), mini_epochs=self.mini_epochs)

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), mini_epochs=self.mini_epochs)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mini_epochs") != self.mini_epochs:
            raise ValueError(
                f"sampler state is for {state.get('mini_epochs')!r} mini-epochs, this sampler "
                f"has {self.mini_epochs}"
            )
        super().load_state_dict(state)

    def mini_epoch_bounds(self) -> list[int]:
        """Positions in this rank's order where each mini-epoch starts, and its length last."""
        return np.cumsum([0] + group_sizes(self.num_samples, self.mini_epochs)).tolist()
