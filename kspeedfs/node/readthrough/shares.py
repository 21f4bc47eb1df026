"""Each read-through dataset's fair share of the memory they share: weighted max-min
(water-filling), the one place that arithmetic lives.

A dataset never gets more than it can hold (its size); what a small dataset leaves goes to the
others by weight. The evictor (evict.py) lets a miss take memory from another dataset only
when that one is over its share by at least a segment and the miss's own dataset is under
its share, so holdings settle at the shares and never move back and forth."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Demand(NamedTuple):
    size: int  # bytes the dataset would hold if it were all in memory
    weight: float = 1.0


def fair_shares(pool: int, demands: Mapping[str, Demand]) -> dict[str, int]:
    """Bytes of `pool` each entity is owed: by weight, none more than its size, and what a
    capped-by-size entity leaves shared again among the rest."""
    shares = dict.fromkeys(demands, 0)
    left = max(0, pool)
    # Whoever needs the least per unit of weight is filled first: what it leaves is spread.
    waiting = sorted(demands, key=lambda n: demands[n].size / demands[n].weight)
    while waiting:
        weights = sum(demands[n].weight for n in waiting)
        name = waiting[0]
        per_weight = left / weights
        if demands[name].size <= per_weight * demands[name].weight:
            shares[name] = demands[name].size
            left -= demands[name].size
            waiting.pop(0)
            continue
        for n in waiting:
            shares[n] = int(per_weight * demands[n].weight)
        break
    return shares
