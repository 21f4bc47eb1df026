"""Weighted max-min shares with floors (shares.py) against their definition, for any demands."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.node.readthrough.shares import Demand, fair_shares

demands = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.builds(
        Demand,
        st.integers(0, 1 << 30),
        st.integers(1, 10),
        st.one_of(st.just(0), st.integers(0, 1 << 28)),
    ),
    max_size=8,
)


@given(st.integers(0, 1 << 31), demands)
def test_shares_are_max_min_fair_above_the_floors(pool: int, wanted: dict[str, Demand]) -> None:
    shares = fair_shares(pool, wanted)
    assert shares.keys() == wanted.keys()
    slack = len(wanted) + 1  # each share is rounded down to a whole byte
    low = {n: min(d.floor, d.size) for n, d in wanted.items()}
    assert all(low[n] <= shares[n] <= d.size for n, d in wanted.items())
    if sum(low.values()) <= pool:
        # Work-conserving: all of the pool is given, unless every demand is met.
        assert sum(shares.values()) >= min(pool, sum(d.size for d in wanted.values())) - slack
        assert sum(shares.values()) <= pool
    # Max-min: one that got less than it wants, above its floor, got at least as much per
    # weight as any other got above its own floor.
    for n, d in wanted.items():
        if shares[n] < d.size:
            for m, e in wanted.items():
                if shares[m] > low[m] + 1:
                    assert shares[n] / d.weight >= shares[m] / e.weight - 2


def test_even_weights_split_evenly_and_a_small_dataset_leaves_its_rest() -> None:
    even = {"a": Demand(100), "b": Demand(100), "c": Demand(100)}
    assert fair_shares(90, even) == {"a": 30, "b": 30, "c": 30}
    small = {"a": Demand(10), "b": Demand(100), "c": Demand(100)}
    assert fair_shares(90, small) == {"a": 10, "b": 40, "c": 40}


def test_weights_and_floors() -> None:
    assert fair_shares(100, {"a": Demand(1000, 3), "b": Demand(1000, 1)}) == {"a": 75, "b": 25}
    # A floor above the even split is kept; the rest is shared.
    floored = {"a": Demand(1000, 1, 60), "b": Demand(1000), "c": Demand(1000)}
    assert fair_shares(100, floored) == {"a": 60, "b": 20, "c": 20}
    # A floor is never more than the dataset.
    assert fair_shares(100, {"a": Demand(10, 1, 60), "b": Demand(1000)}) == {"a": 10, "b": 90}
