"""Budgets (node/budget.py) in process: claims, their release, refusals and reclaimers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.format.errors import AlreadyExists, NoSpace
from kspeedfs.node.budget import Budgets

# Any folder does for the filesystem checks: the budgets here are far below its free space.
HERE = Path(__file__).parent
KIB = 1024


@dataclasses.dataclass
class Record:
    stored: int = 0
    disk_stored: int = 0


def budgets(
    memory: int = 64 * KIB, disk: int = 0, **datasets: Record
) -> tuple[Budgets, dict[str, Record]]:
    table = dict(datasets)
    return Budgets(HERE, memory, table, HERE if disk else None, disk), table


def test_a_claim_counts_until_released_and_its_release_is_told() -> None:
    b, _ = budgets(pinned=Record(stored=16 * KIB))
    told: list[str] = []
    b.when_memory_freed(lambda: told.append("freed"))
    b.reserve("load", 8 * KIB)
    assert b.used() == 24 * KIB
    assert b.memory_free() == 40 * KIB
    b.release("load")
    assert b.used() == 16 * KIB
    assert told == ["freed"]
    b.release("load")  # gone already: nothing happens, nobody is told
    assert told == ["freed"]


def test_a_claim_past_the_budget_is_refused_in_one_line_and_claims_nothing() -> None:
    b, _ = budgets(pinned=Record(stored=60 * KIB))
    with pytest.raises(NoSpace) as refused:
        b.reserve("load", 8 * KIB, what="segment 3 of big")
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "segment 3 of big needs 8.0 KiB on this node but only 4.0 KiB of its 64.0 KiB budget"
        " is free (held by pinned 60.0 KiB)"  # who holds the memory, largest first
    )
    assert b.reserved == {}
    assert b.used() == 60 * KIB


def test_a_name_taken_by_a_dataset_or_a_claim_is_refused() -> None:
    b, _ = budgets(pinned=Record(stored=KIB))
    with pytest.raises(AlreadyExists):
        b.reserve("pinned", KIB)
    b.reserve("load", KIB)
    with pytest.raises(AlreadyExists):
        b.reserve("load", KIB)
    assert b.used() == 2 * KIB


def test_a_claim_instead_of_another_counts_its_bytes_free_and_keeps_it_when_refused() -> None:
    b, _ = budgets()
    b.reserve("admission", 48 * KIB)
    b.reserve("stage", 60 * KIB, instead_of="admission")  # fits only in place of it
    assert set(b.reserved) == {"stage"}
    b.release("stage")
    b.reserve("admission", 48 * KIB)
    with pytest.raises(NoSpace):
        b.reserve("stage", 65 * KIB, instead_of="admission")
    assert set(b.reserved) == {"admission"}


def test_reclaimers_free_the_shortfall_when_eviction_is_allowed() -> None:
    b, table = budgets(cached=Record(stored=60 * KIB))
    asked: list[int] = []

    def reclaim(nbytes: int) -> int:
        asked.append(nbytes)
        table["cached"].stored -= nbytes  # evicted
        b.drop_claim("nothing")  # a reclaimer runs under the lock: this must not take it
        return nbytes

    b.add_reclaimer(reclaim)
    with pytest.raises(NoSpace):
        b.reserve("thread", 8 * KIB, evict=False)
    assert asked == []
    b.reserve("load", 8 * KIB)
    assert asked == [4 * KIB]
    assert b.used() == 64 * KIB


def test_disk_reclaimers_serve_disk_claims_only() -> None:
    b, table = budgets(disk=32 * KIB, spilled=Record(disk_stored=30 * KIB))
    memory_asked: list[int] = []
    disk_asked: list[int] = []
    b.add_reclaimer(lambda n: memory_asked.append(n) or 0)

    def reclaim_disk(nbytes: int) -> int:
        disk_asked.append(nbytes)
        table["spilled"].disk_stored -= nbytes
        return nbytes

    b.add_reclaimer(reclaim_disk, tier="disk")
    told: list[str] = []
    b.when_memory_freed(lambda: told.append("freed"))
    b.reserve("disk:1", 4 * KIB, tier="disk")
    assert (disk_asked, memory_asked) == ([2 * KIB], [])
    assert b.disk_used() == 32 * KIB
    assert b.used() == 0
    b.release("disk:1")
    assert told == []  # disk given back frees no memory


def test_no_disk_tier_refuses_disk_claims() -> None:
    b, _ = budgets()
    assert b.disk_free() == 0
    with pytest.raises(NoSpace, match="^segment 1 of x needs a disk tier, and this node has none"):
        b.reserve("disk:1", KIB, what="segment 1 of x", tier="disk")


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["reserve", "release"]), st.integers(0, 5), st.integers(0, 40)),
        max_size=40,
    )
)
def test_claims_never_take_more_than_the_budget(steps: list[tuple[str, int, int]]) -> None:
    """Whatever claims come and go, the budget counts exactly the ones granted, and never
    grants past it: what is free is what a claim of that size would be granted."""
    b, _ = budgets(memory=64 * KIB, pinned=Record(stored=8 * KIB))
    granted: dict[str, int] = {}
    for op, key, kib in steps:
        name = f"claim{key}"
        if op == "release":
            b.release(name)
            granted.pop(name, None)
            continue
        free = b.memory_free()
        try:
            b.reserve(name, kib * KIB)
        except AlreadyExists:
            assert name in granted
            continue
        except NoSpace:
            assert kib * KIB > free
            continue
        assert kib * KIB <= free
        granted[name] = kib * KIB
        assert b.used() == 8 * KIB + sum(granted.values()) <= 64 * KIB
    assert b.memory_free() == 56 * KIB - sum(granted.values())


def test_spilled_copies_give_way_to_a_heal_and_to_a_cap_but_not_to_each_other() -> None:
    """A spilled read-through copy (gives_way) holds disk-tier room only while nothing else
    needs it: a heal's segment, claimed from a thread that cannot drop it, may take that room,
    and a preload's cap is checked against it as free; another spilled copy and a read-through
    miss onto the tier (which make the copies go themselves) see no room."""
    b, table = budgets(disk=64 * KIB, pinned=Record(disk_stored=16 * KIB))
    b.reserve("rtspill:a:0", 32 * KIB, tier="disk", evict=False, gives_way=True)
    b.reserve("rtspill:a:1", 16 * KIB, tier="disk", evict=False, gives_way=True)
    assert b.disk_used() == 64 * KIB
    assert b.disk_free() == 48 * KIB  # the copies' room counts as free for a cap
    for claim in ("rtspill:a:2", "rtdisk:a:3"):  # another copy, a miss onto the tier
        with pytest.raises(NoSpace):
            b.reserve(claim, 8 * KIB, tier="disk", evict=False, gives_way=claim[2] == "s")
    b.reserve("segment:ds:5", 40 * KIB, tier="disk", evict=False, over_giving=True)
    with pytest.raises(NoSpace):  # more than the copies hold
        b.reserve("segment:ds:6", 16 * KIB, tier="disk", evict=False, over_giving=True)
    # The heal is counted at once; the copies' owner drops them at its next spill.
    assert b.disk_used() == 104 * KIB
    b.release("rtspill:a:0")
    b.release("rtspill:a:1")
    assert b.disk_used() == 56 * KIB
    assert set(b.reserved) == {"segment:ds:5"}
    assert table["pinned"].disk_stored == 16 * KIB


CLAIM_OPS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release", "drop"]),
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(1, 8 * KIB),
        st.sampled_from(["memory", "disk"]),
        st.booleans(),
    ),
    max_size=40,
)


@given(CLAIM_OPS)
def test_the_running_sums_equal_the_claims_summed(ops: list) -> None:
    """The budgets keep running sums of their claims: after any sequence of claims, releases
    and drops (refusals included) they equal the claims summed."""
    b, _ = budgets(memory=32 * KIB, disk=32 * KIB, pinned=Record(stored=KIB, disk_stored=KIB))
    for op, name, nbytes, tier, gives_way in ops:
        if op == "reserve":
            try:
                b.reserve(name, nbytes, tier=tier, gives_way=gives_way and tier == "disk")
            except (AlreadyExists, NoSpace):
                pass
        elif op == "release":
            b.release(name)
        else:
            with b.lock:
                b.drop_claim(name)
        claims = list(b.reserved.values())
        memory = sum(r.nbytes for r in claims if r.tier == "memory")
        disk = sum(r.nbytes for r in claims if r.tier == "disk")
        giving = sum(r.nbytes for r in claims if r.gives_way)
        assert b.used() == KIB + memory
        assert b.disk_used() == KIB + disk
        # (the folder's filesystem has far more free than these budgets)
        assert b.disk_free() == max(0, 32 * KIB - KIB - disk + giving)


def test_the_claims_are_read_only_outside() -> None:
    b, _ = budgets()
    b.reserve("load", KIB)
    with pytest.raises(TypeError):
        b.reserved["other"] = b.reserved["load"]  # type: ignore[index]
