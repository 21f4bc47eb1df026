"""Each read-through dataset's fair share of the memory they share: weighted max-min with
floors (water-filling), the one place that arithmetic lives.

A dataset is owed at least its floor (`min_memory`, or its size if smaller) and never more
than its size; above the floors, the pool goes by weight, and what a dataset smaller than its
weighted part leaves goes to the others. The evictor (evict.py) lets a miss take memory from
another dataset only when that one is over its share by at least a segment and the miss's own
dataset is under its share, so holdings settle at the shares and never move back and forth."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Demand(NamedTuple):
    size: int  # bytes the dataset would hold if it were all in memory
    weight: float = 1.0
    floor: int = 0  # bytes owed to it whatever the others want


def fair_shares(pool: int, demands: Mapping[str, Demand]) -> dict[str, int]:
    """Bytes of `pool` each entity is owed: the level L at which every entity's
    clamp(L x weight, floor, size) sums to the pool (all sizes if the pool holds them, the
    floors if it holds no more)."""
    low = {n: min(d.floor, d.size) for n, d in demands.items()}
    if sum(d.size for d in demands.values()) <= pool:
        return {n: d.size for n, d in demands.items()}
    if sum(low.values()) >= pool:
        return low

    def given(level: float) -> dict[str, float]:
        return {n: min(d.size, max(low[n], level * d.weight)) for n, d in demands.items()}

    lo, hi = 0.0, max(d.size / d.weight for d in demands.values())
    for _ in range(64):  # the sum grows with the level: bisect to a byte's precision
        mid = (lo + hi) / 2
        if sum(given(mid).values()) > pool:
            hi = mid
        else:
            lo = mid
    return {n: int(share) for n, share in given(lo).items()}
