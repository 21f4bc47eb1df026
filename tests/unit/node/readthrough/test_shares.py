"""Weighted max-min shares (shares.py) against their definition, for any demands."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.node.readthrough.shares import Demand, fair_shares

demands = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.builds(
        Demand,
        st.integers(0, 1 << 30),
        st.floats(0.1, 10, allow_nan=False, allow_infinity=False),
    ),
    max_size=8,
)


@given(st.integers(0, 1 << 31), demands)
def test_shares_are_max_min_fair(pool: int, wanted: dict[str, Demand]) -> None:
    shares = fair_shares(pool, wanted)
    assert shares.keys() == wanted.keys()
    slack = len(wanted)  # each share is rounded down to a whole byte
    assert all(0 <= shares[n] <= wanted[n].size for n in wanted)
    # Work-conserving: all of the pool is given, unless every demand is met.
    assert sum(shares.values()) >= min(pool, sum(d.size for d in wanted.values())) - slack
    assert sum(shares.values()) <= pool or pool < 0
    # Max-min: one that got less than it wants got at least as much per weight as any other.
    for n, d in wanted.items():
        if shares[n] < d.size:
            for m, e in wanted.items():
                assert shares[n] / d.weight >= shares[m] / e.weight - 1 / min(d.weight, e.weight)


def test_equal_weights_split_evenly_and_a_small_dataset_leaves_its_rest() -> None:
    assert fair_shares(90, {"a": Demand(100), "b": Demand(100), "c": Demand(100)}) == {
        "a": 30,
        "b": 30,
        "c": 30,
    }
    assert fair_shares(90, {"a": Demand(10), "b": Demand(100), "c": Demand(100)}) == {
        "a": 10,
        "b": 40,
        "c": 40,
    }
    assert fair_shares(100, {"a": Demand(1000, 3), "b": Demand(1000, 1)}) == {"a": 75, "b": 25}
