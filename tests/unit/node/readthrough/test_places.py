"""The places of a read-through instance's segments (node/readthrough/places.py) in process:
the one owner records where each segment lies and counts it, in the store's record (the
memory budget) and in the disk tier's budget, in the same call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.node.budget import Budgets
from kspeedfs.node.readthrough.places import InstancePlaces
from kspeedfs.node.records import DatasetRecord

KIB = 1024
SEG = 4 * KIB
# Any folder does for the filesystem checks: the budgets here are far below its free space.
HERE = Path(__file__).parent


def instance(
    segments: int = 8, memory: int = 64 * KIB, disk: int = 16 * KIB
) -> tuple[InstancePlaces, Budgets]:
    record = DatasetRecord(
        name="ds",
        uuid="u1",
        source="/src",
        lifetime="readthrough",
        replicas=1,
        files=segments,
        bytes=segments * SEG,
        stored=0,
        created=0.0,
        path=HERE,
        segments=segments,
    )
    budgets = Budgets(HERE, memory, {"ds": record}, HERE, disk)
    return InstancePlaces(record, np.full(segments, SEG, dtype="<u8"), budgets), budgets


def test_memory_places_are_the_records_and_count_in_the_memory_budget() -> None:
    places, budgets = instance()
    places.found([3, 1], base=100)
    assert set(places.memory) == {1, 3} and places.record.held == [1, 3]
    assert places.record.stored == 100 + 2 * SEG
    places.cached(5)
    places.cached(5)  # told twice: counted once
    assert sorted(places.record.held) == [1, 3, 5]
    assert budgets.used() == 100 + 3 * SEG
    assert places.evicted(3) == SEG
    assert places.evicted(3) == 0  # gone already
    assert set(places.memory) == {1, 5} and sorted(places.record.held) == [1, 5]
    assert budgets.used() == 100 + 2 * SEG
    assert places.holds(1) and not places.holds(3)


def test_disk_places_are_claims_on_the_disk_budget_from_fill_to_forget() -> None:
    places, budgets = instance(disk=3 * SEG)
    assert places.claim_disk(0, "segment 0 of ds")
    assert not places.claim_disk(0, "segment 0 of ds")  # claimed already
    assert budgets.disk_used() == SEG and not places.holds(0)  # a fill onto it, not there yet
    places.placed_on_disk(0)
    assert places.holds(0) and set(places.disk) == {0} and places.disk_bytes() == SEG
    assert places.claim_disk(1, "s") and places.claim_disk(2, "s")
    assert not places.claim_disk(3, "s")  # the tier's budget is full: nothing evicted for it
    assert places.claimed_bytes() == 3 * SEG and places.disk_bytes() == SEG
    places.release_disk(1)  # a fill onto the disk that failed
    assert budgets.disk_used() == 2 * SEG and not places.claimed(1)
    with budgets.lock:  # a preload's reclaim, under the budgets' lock
        assert places.reclaimed_from_disk(0) == SEG
    assert budgets.disk_used() == SEG and set(places.disk) == set()
    places.forget()
    assert budgets.disk_used() == 0 and budgets.reserved == {}
    assert places.record.disk == [] and places.record.disk_stored == 0  # meta.json's: a preload's


def test_a_promotion_moves_the_count_from_the_disk_budget_to_memory() -> None:
    places, budgets = instance()
    places.found([], base=0)
    assert places.claim_disk(4, "s")
    places.placed_on_disk(4)
    places.promoted(4)
    assert set(places.memory) == {4} and set(places.disk) == set()
    assert budgets.disk_used() == 0 and budgets.used() == SEG
    assert places.record.held == [4]


PLACE_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "claim_disk",
                "placed_on_disk",
                "release_disk",
                "reclaimed_from_disk",
                "claim_spill",
                "placed_spilled",
                "spill_used",
                "release_spill",
                "reclaimed_spill",
                "forget",
            ]
        ),
        st.integers(0, 2),  # few segments: the same one claimed, placed and let go
    ),
    max_size=50,
)


@settings(max_examples=300)
@given(PLACE_OPS)
def test_the_running_sums_equal_the_places_summed(ops: list[tuple[str, int]]) -> None:
    """The places keep running sums of their disk and spilled bytes and an LRU order of the
    spilled copies: after any sequence of what callers may tell them, they equal the places
    summed, and the oldest copy is the one least recently placed or used."""
    places, budgets = instance(segments=3, disk=4 * SEG)
    # What may only be told of a claimed segment (as the callers do).
    needs = {
        "placed_on_disk": places.claimed,
        "reclaimed_from_disk": places.claimed,
        "placed_spilled": places.spill_claimed,
        "reclaimed_spill": places.spill_claimed,
    }
    for clock, (op, seg) in enumerate(ops):
        if op in needs and not needs[op](seg):
            continue
        tell = getattr(places, op)
        if op == "forget":
            tell()
        elif op.startswith("claim"):
            tell(seg, "s")
        elif op in ("placed_spilled", "spill_used"):
            tell(seg, float(clock))
        elif op.startswith("reclaimed"):
            with budgets.lock:  # a preload's reclaim, under the budgets' lock
                tell(seg)
        else:
            tell(seg)
        claimed = [k for k in range(3) if places.claimed(k)]
        claimed += [k for k in range(3) if places.spill_claimed(k)]
        assert places.claimed_bytes() == SEG * len(claimed) == budgets.disk_used()
        assert places.disk_bytes() == SEG * len(places.disk)
        assert places.spilled_bytes() == SEG * len(places.spilled)
        if places.spilled:
            when, oldest = min((w, k) for k, w in places.spilled.items())
            assert places.oldest_spilled() == (when, oldest)
        else:
            assert places.oldest_spilled() is None
