"""The Promoter (node/promote.py) in process: one order, one check of free memory and caps, one
handling of damaged copies and failures, over a preloaded and a read-through kind of dataset
(each a fake `Promotable` over a real memory budget)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio

from kspeedfs.format.errors import NoSpace
from kspeedfs.format.localdata import DamagedSegment
from kspeedfs.node.budget import Budgets
from kspeedfs.node.promote import DiskSegment, Promoter

# Any folder does for the filesystem checks: the budgets here are far below its free space.
HERE = Path(__file__).parent
SEG = 1024


@dataclasses.dataclass
class Record:
    stored: int = 0
    disk_stored: int = 0


class Kind:
    """A kind of dataset whose disk segments a test lays out: moving one counts it in memory
    and writes down who moved what, in `events`."""

    def __init__(
        self,
        label: str,
        table: dict[str, Record],
        events: list[tuple[str, ...]],
        on_disk: dict[str, list[int]],
        caps: dict[str, int] | None = None,
    ):
        self.label = label
        self.table = table
        self.events = events
        self.on_disk = on_disk
        self.caps = caps or {}
        self.damaged_copies: set[tuple[str, int]] = set()
        self.failing: set[tuple[str, int]] = set()
        self.promoted = {"segments": 0, "bytes": 0}
        for name in on_disk:
            table[name] = Record()

    def waiting(self) -> list[DiskSegment]:
        return [
            DiskSegment(n, "uuid", segs[0], SEG, self._room(n))
            for n, segs in self.on_disk.items()
            if segs
        ]

    def _room(self, name: str) -> int | None:
        cap = self.caps.get(name)
        return None if cap is None else cap - self.table[name].stored

    async def move(self, segment: DiskSegment) -> int:
        where = (segment.name, segment.seg)
        if where in self.failing:
            raise NoSpace("the shm filesystem is full")
        if where in self.damaged_copies:
            raise DamagedSegment(f"segment {segment.seg} of {segment.name} is short", [segment.seg])
        self.on_disk[segment.name].remove(segment.seg)
        self.table[segment.name].stored += SEG
        self.events.append(("moved", self.label, *map(str, where)))
        return SEG

    async def damaged(self, segment: DiskSegment, e: DamagedSegment) -> None:
        self.on_disk[segment.name].remove(segment.seg)
        self.events.append(("damaged", self.label, segment.name, str(segment.seg)))

    def settled(self, name: str) -> None:
        self.events.append(("settled", self.label, name))


def promoter(
    memory: int, preloads: dict[str, list[int]], cached: dict[str, list[int]], **caps: int
) -> tuple[Promoter, Kind, Kind, list[tuple[str, ...]]]:
    """A Promoter over a memory budget of `memory` bytes, a preloaded and a read-through kind
    with those disk segments, and the dataset caps `caps`; and what it does (`events`)."""
    table: dict[str, Record] = {}
    events: list[tuple[str, ...]] = []
    preload = Kind("preload", table, events, preloads, caps)
    cache = Kind("cache", table, events, cached, caps)
    return Promoter(Budgets(HERE, memory, table), [preload, cache]), preload, cache, events


def moves(events: list[tuple[str, ...]]) -> list[str]:
    return [f"{e[2]}:{e[3]}" for e in events if e[0] == "moved"]


def test_one_order_over_both_kinds_dataset_name_then_segment() -> None:
    p, preload, cache, events = promoter(
        64 * SEG, preloads={"b": [0, 1], "d": [3]}, cached={"a": [5, 6], "c": [0]}
    )
    assert trio.run(p.promote_what_fits)
    assert moves(events) == ["a:5", "a:6", "b:0", "b:1", "c:0", "d:3"]
    # Each dataset is told once, when its run of moves ends (a read-through one's readers look
    # again then).
    settled = [e[1:] for e in events if e[0] == "settled"]
    assert settled == [("cache", "a"), ("preload", "b"), ("cache", "c"), ("preload", "d")]
    assert preload.promoted == {"segments": 3, "bytes": 3 * SEG}
    assert cache.promoted == {"segments": 3, "bytes": 3 * SEG}


def test_free_memory_and_each_cap_are_checked_once_for_both_kinds() -> None:
    # Room for three segments; "a" may hold one, "b" two.
    p, _, _, events = promoter(
        3 * SEG, preloads={"b": [0, 1, 2]}, cached={"a": [0, 1], "c": [0]}, a=SEG, b=2 * SEG
    )
    assert trio.run(p.promote_what_fits)
    assert moves(events) == ["a:0", "b:0", "b:1"]  # "c" finds memory full


def test_a_damaged_copy_goes_to_its_kind_and_the_moves_go_on() -> None:
    p, preload, cache, events = promoter(64 * SEG, preloads={"b": [0, 1]}, cached={"a": [0, 1]})
    preload.damaged_copies.add(("b", 0))
    cache.damaged_copies.add(("a", 1))
    assert trio.run(p.promote_what_fits)
    assert [e for e in events if e[0] != "settled"] == [
        ("moved", "cache", "a", "0"),
        ("damaged", "cache", "a", "1"),
        ("damaged", "preload", "b", "0"),
        ("moved", "preload", "b", "1"),
    ]
    assert preload.promoted["segments"] == cache.promoted["segments"] == 1


@pytest.mark.parametrize(("failing", "moved"), [("a", []), ("b", ["a:0"])])
def test_a_failed_move_ends_the_look_whichever_kind_failed(failing: str, moved: list[str]) -> None:
    """The filesystem, not the budget, was short: nothing more moves until the next look."""
    p, preload, cache, events = promoter(64 * SEG, preloads={"b": [0], "d": [0]}, cached={"a": [0]})
    (cache if failing == "a" else preload).failing.add((failing, 0))
    assert not trio.run(p.promote_what_fits)
    assert moves(events) == moved
