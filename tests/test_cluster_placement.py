"""Unit tests of rendezvous placement: deterministic, balanced, minimal movement."""

from __future__ import annotations

import functools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.format.placement import assignment, owners

NODES = [f"10.0.0.{i}:7420" for i in range(1, 9)]
NEW = "10.0.0.99:7420"
# Enough segments that a fair random placement is within 5% per node with ~4 sigma to spare.
SEGMENTS = 48_000


@functools.cache
def ranked(nodes: tuple[str, ...]) -> list[list[str]]:
    """The top 3 owners of every segment; the top R for fewer replicas are their prefix."""
    return [owners("imagenet", seg, nodes, 3) for seg in range(SEGMENTS)]


def owner_map(nodes: list[str], replicas: int = 1) -> list[list[str]]:
    return [top[:replicas] for top in ranked(tuple(nodes))]


def test_owners_are_distinct_ranked_and_independent_of_list_order() -> None:
    for seg in range(200):
        top3 = owners("ds", seg, NODES, 3)
        assert len(top3) == 3 == len(set(top3))
        # The best owner is the same whatever the replica count (reads try it first).
        assert owners("ds", seg, NODES, 1) == top3[:1]
        assert owners("ds", seg, list(reversed(NODES)), 3) == top3
    assert owners("ds", 0, NODES[:2], 5) == owners("ds", 0, NODES[:2], 2)
    assert owners("ds", 0, NODES, 0) == owners("ds", 0, NODES, 1)


def test_placement_depends_on_dataset_and_segment() -> None:
    a = [owners("one", seg, NODES)[0] for seg in range(400)]
    b = [owners("two", seg, NODES)[0] for seg in range(400)]
    assert a != b
    assert len(set(a)) == len(NODES)


def test_balance_within_a_few_percent() -> None:
    for replicas in (1, 2, 3):
        counts = Counter(n for seg_owners in owner_map(NODES, replicas) for n in seg_owners)
        expected = SEGMENTS * replicas / len(NODES)
        assert set(counts) == set(NODES)
        for node, count in counts.items():
            assert abs(count - expected) / expected < 0.05, (replicas, node, count, expected)


def test_assignment_lists_every_node_and_each_segment_replicas_times() -> None:
    placed = assignment("ds", 500, NODES + ["idle:1"], replicas=2)
    assert set(placed) == set(NODES) | {"idle:1"}
    per_segment = Counter(seg for segs in placed.values() for seg in segs)
    assert per_segment == Counter({seg: 2 for seg in range(500)})
    assert assignment("ds", 0, NODES) == {n: [] for n in NODES}


def test_adding_a_node_moves_only_what_the_new_node_gains() -> None:
    bigger = NODES + [NEW]
    for replicas in (1, 2):
        before, after = owner_map(NODES, replicas), owner_map(bigger, replicas)
        moved = 0
        for old, new in zip(before, after, strict=True):
            if old != new:
                moved += 1
                # The new node took one slot; the others kept their order, the last dropped out.
                assert NEW in new
                assert [n for n in new if n != NEW] == old[: replicas - 1]
        expected = SEGMENTS * replicas / len(bigger)
        assert abs(moved - expected) / expected < 0.05, (replicas, moved, expected)


def test_removing_a_node_moves_only_what_it_held() -> None:
    gone = NODES[3]
    smaller = [n for n in NODES if n != gone]
    for replicas in (1, 2):
        before, after = owner_map(NODES, replicas), owner_map(smaller, replicas)
        for old, new in zip(before, after, strict=True):
            if gone not in old:
                assert new == old
            else:
                survivors = [n for n in old if n != gone]
                assert new[: len(survivors)] == survivors
                assert len(new) == replicas and gone not in new


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.lists(
        st.from_regex(r"[a-z0-9.]{1,12}:[0-9]{1,5}", fullmatch=True),
        min_size=2,
        max_size=10,
        unique=True,
    ),
    dataset=st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True),
    replicas=st.integers(1, 3),
    data=st.data(),
)
def test_membership_change_never_moves_untouched_segments(
    nodes: list[str], dataset: str, replicas: int, data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(nodes))
    rest = [n for n in nodes if n != gone]
    for seg in range(64):
        old = owners(dataset, seg, nodes, replicas)
        new = owners(dataset, seg, rest, replicas)
        if gone not in old:
            assert new == old
        assert set(old) - {gone} <= set(new)
