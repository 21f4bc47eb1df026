"""The store-wide eviction policies on their own: least recently used, exactly as the node has
always evicted (a segment joins as the newest, a read makes it the newest again, a segment
that becomes resident again keeps its place, a victim leaves the policy); stable, which
never evicts a dataset for itself; the plan's choice against the uses it counts."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.node.readthrough.policy import (
    Key,
    LeastRecentlyUsed,
    PlannedUses,
    ReadersPlan,
    StableResidentSet,
)

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


def test_stable_never_evicts_a_dataset_for_itself() -> None:
    policy = StableResidentSet()
    for key in [("a", 0), ("b", 0), ("a", 1), ("b", 1)]:
        policy.admitted(key)
    assert policy.victim(("a", 5), others=[]) is None  # a full share: the miss is not kept
    assert policy.victim(("a", 5), others=["a"]) is None  # not even when offered itself
    assert policy.victim(("a", 5), others=["b"]) == ("b", 0)  # the oldest of another
    assert policy.victim(None, others=["a", "b"]) == ("a", 0)  # a preload's room: any, oldest


PLAN_USES = st.lists(st.integers(0, 7), min_size=1, max_size=80)


@given(
    st.lists(st.tuples(PLAN_USES, st.integers(0, 80)), min_size=1, max_size=2),
    st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
    st.integers(0, 7),
    st.integers(0, 2),
)
def test_the_plan_evicts_only_a_segment_with_fewer_uses_ahead(
    plans: list[tuple[list[int], int]], resident: list[int], incoming: int, margin: int
) -> None:
    """Whatever the plans (one per rank, each with its readers somewhere in it): a victim of
    the miss's own dataset has fewer uses in the horizons, summed over the plans, than the
    miss (less the one being read), by more than the margin, and none of the residents that
    stay has fewer; no victim means none had."""
    policy = PlannedUses()
    for seg in resident:
        policy.admitted(("a", seg))
    for rank, (uses, at) in enumerate(plans):
        reader = f"{rank}/{len(plans)}"
        policy.planned("a", np.array(uses, dtype=np.int64), margin=margin, reader=reader)
        plan = policy.plans["a"][reader]
        plan.cursor = min(at, len(uses) - 1)
    ranks = policy.plans["a"].values()
    ahead = {seg: sum(p.uses_ahead(seg) for p in ranks) for seg in {*resident, incoming}}
    victim = policy.victim(("a", incoming), others=[])
    need = max(0, ahead[incoming] - 1) - margin  # its own use, being read, not counted
    if victim is None:
        assert all(ahead[seg] >= need for seg in resident if seg != incoming)
    else:
        assert victim[0] == "a" and victim[1] in resident
        assert ahead[victim[1]] < need
        assert all(ahead[victim[1]] <= ahead[seg] for seg in resident)
        assert len(policy) == len(resident) - 1


def test_each_reader_has_its_plan_and_cursor_and_a_newer_plan_replaces_only_its_own() -> None:
    policy = PlannedUses()
    first, second = np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])
    policy.planned("a", first, reader="0/2")
    policy.planned("a", second, reader="1/2")
    for seg in (1, 2, 5):
        policy.used(("a", seg))  # each miss moves only the plan that holds it
    assert policy.plan_position("a") == {"0/2": (1, 4), "1/2": (1, 4)}
    assert policy.uses_ahead(("a", 3)) == 1 and policy.uses_ahead(("a", 7)) == 1
    policy.planned("a", np.array([3, 3, 3, 3]), reader="0/2")  # rank 0's next plan
    assert policy.plan_position("a") == {"1/2": (1, 4), "0/2": (0, 4)}
    assert policy.uses_ahead(("a", 3)) == 2  # rank 0's uses in its horizon; rank 1 has none
    for rank in range(2, PlannedUses.MAX_READERS + 1):
        policy.planned("a", first, reader=f"{rank}/65")
    readers = policy.plan_position("a") or {}
    assert len(readers) == PlannedUses.MAX_READERS and "1/2" not in readers  # the oldest went
    policy.dropped_plan("a")
    assert policy.plan_position("a") is None and policy.uses_ahead(("a", 3)) == 0


def test_the_readers_cursor_follows_their_misses_and_ignores_reads_off_the_plan() -> None:
    plan = ReadersPlan(np.array([3, 1, 2, 0, 0, 3], dtype=np.int64), window=2)
    plan.MATCHES = 1  # the median of one match: each match ahead moves the cursor
    plan._matches = deque(maxlen=1)
    plan.observe(1)
    assert plan.cursor == 1 and plan.uses_ahead(2) == 1 and plan.uses_ahead(3) == 0
    plan.observe(9)  # not in the plan
    plan.observe(3)  # its use nearest the cursor is behind it: a lagging reader
    assert plan.cursor == 1
    plan.observe(2)
    assert plan.cursor == 2 and plan.uses_ahead(2) == 0 and plan.uses_ahead(0) == 2


@settings(deadline=None)  # 600 steps a case: over 200 ms on a loaded machine or under coverage
@given(st.integers(0, 2**32 - 1), st.sampled_from([0, 64, 128]))
def test_the_cursor_stays_near_the_readers_on_repeated_draws(seed: int, lag: int) -> None:
    """Two readers `lag` uses apart, each use a miss half of the time, over a plan of draws
    with replacement (segments used several times at random places): the cursor never gets
    ahead of the front reader by more than a few uses, nor behind the lagging one."""
    rng = np.random.default_rng(seed)
    n = 600
    uses = rng.integers(0, n, 2 * n)
    plan = ReadersPlan(uses, window=128)
    behind = []
    for t in range(n):
        for pos in (t, t - lag):
            if pos >= 0 and rng.random() < 0.5:
                plan.observe(int(uses[pos]))
        assert plan.cursor <= t + 16
        behind.append(t - plan.cursor)
    assert np.mean(behind) <= lag + 32  # between the two readers, on the whole


def test_a_datasets_plans_together_hold_at_most_max_uses_the_newest_kept() -> None:
    policy = PlannedUses()
    policy.MAX_USES = 10
    for rank in range(3):
        policy.planned("a", np.arange(4), reader=f"{rank}/3")
    assert list(policy.plan_position("a") or {}) == ["1/3", "2/3"]  # 8 uses; 12 were over
    policy.planned("a", np.arange(40), reader="0/3")  # one over the limit alone: still kept
    assert list(policy.plan_position("a") or {}) == ["0/3"]
