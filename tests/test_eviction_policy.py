"""The store-wide eviction policy on its own: least recently used, exactly as the node has
always evicted (a segment joins as the newest, a read makes it the newest again, a segment
that becomes resident again keeps its place, a victim leaves the policy)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.node.readthrough.policy import Key, LeastRecentlyUsed

KEYS = st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5))
STEPS = st.lists(
    st.tuples(st.sampled_from(["admitted", "used", "forgotten", "victim"]), KEYS), max_size=60
)


def test_the_oldest_goes_first_and_a_read_makes_a_segment_the_newest() -> None:
    policy = LeastRecentlyUsed()
    for seg in range(3):
        policy.admitted(("a", seg))
    policy.used(("a", 0))
    policy.used(("b", 9))  # not resident: nothing to move
    assert [policy.victim() for _ in range(4)] == [("a", 1), ("a", 2), ("a", 0), None]


@given(STEPS)
def test_any_sequence_evicts_in_the_order_of_a_plain_list(steps: list[tuple[str, Key]]) -> None:
    policy = LeastRecentlyUsed()
    order: list[Key] = []  # oldest first
    for step, key in steps:
        if step == "admitted":
            policy.admitted(key)
            if key not in order:
                order.append(key)
        elif step == "used":
            policy.used(key)
            if key in order:
                order.remove(key)
                order.append(key)
        elif step == "forgotten":
            policy.forgotten(key)
            if key in order:
                order.remove(key)
        else:
            assert policy.victim() == (order.pop(0) if order else None)
        assert len(policy) == len(order)
    assert [policy.victim() for _ in order] == order
    assert policy.victim() is None
