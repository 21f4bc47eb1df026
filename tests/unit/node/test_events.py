"""The node's dataset events (node/events.py) in process: followers are told in the order they
subscribed, and a real SegmentStore tells the events it was built with of a publish, an unload
and the damage its own reads find."""

from __future__ import annotations

from pathlib import Path

import pytest

from kspeedfs.format.localdata import DamagedSegment, segment_path
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.readthrough.build import InstanceBuilder
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import open_source

SEG = 4096


class Recorder:
    """A follower that writes down what it is told, under its label."""

    def __init__(self, label: str, told: list[tuple[str, str, str]]):
        self.label = label
        self.told = told

    def published(self, name: str) -> None:
        self.told.append((self.label, "published", name))

    def unloading(self, name: str) -> None:
        self.told.append((self.label, "unloading", name))


def test_followers_are_told_in_the_order_they_subscribed() -> None:
    events = DatasetEvents()
    told: list[tuple[str, str, str]] = []
    for label in ("b", "a", "c"):
        events.follow(Recorder(label, told))
    damage: list[tuple[str, str, list[int]]] = []
    for label in ("y", "x"):
        events.follow_damage(lambda name, segs, label=label: damage.append((label, name, segs)))
    events.published("ds")
    events.unloading("ds")
    events.damage_found("ds", [3, 5])
    assert told == [
        ("b", "published", "ds"),
        ("a", "published", "ds"),
        ("c", "published", "ds"),
        ("b", "unloading", "ds"),
        ("a", "unloading", "ds"),
        ("c", "unloading", "ds"),
    ]
    assert damage == [("y", "ds", [3, 5]), ("x", "ds", [3, 5])]


def test_nobody_following_is_told_nothing() -> None:
    events = DatasetEvents()
    events.published("ds")
    events.unloading("ds")
    events.damage_found("ds", [0])


@pytest.fixture
def store(tmp_path: Path) -> SegmentStore:
    s = SegmentStore(tmp_path / "shm", 1 << 30, events=DatasetEvents())
    s.recover(verify=False)
    return s


def publish_with_a_short_segment(store: SegmentStore, work: Path) -> None:
    """Publish "ds" (a preloaded one: its meta says offline) whose segment 0 is held but
    shorter than its manifest says: the first map of it finds it damaged."""
    src_dir = work / "src"
    src_dir.mkdir()
    (src_dir / "a").write_bytes(b"x" * (SEG + 100))
    src = open_source(str(src_dir))
    staging, meta, _ = InstanceBuilder(store, SEG, "127.0.0.1:1").build("ds", src, src.scan(), None)
    segment_path(staging, 0).write_bytes(b"short")
    store.publish(staging, {**meta, "held": [0], "lifetime": "offline", "readthrough": False})


def test_the_store_tells_its_events_of_a_publish_an_unload_and_damage(
    store: SegmentStore, tmp_path: Path
) -> None:
    told: list[tuple[str, str, str]] = []
    store.events.follow(Recorder("f", told))
    damage: list[tuple[str, list[int]]] = []
    store.events.follow_damage(lambda name, segs: damage.append((name, segs)))

    publish_with_a_short_segment(store, tmp_path)
    assert told == [("f", "published", "ds")]

    with pytest.raises(DamagedSegment):
        store.open("ds").segment(0)
    assert damage == [("ds", [0])]

    store.unload("ds")
    assert told == [("f", "published", "ds"), ("f", "unloading", "ds")]


def test_datasets_found_at_start_are_told_as_published(store: SegmentStore, tmp_path: Path) -> None:
    publish_with_a_short_segment(store, tmp_path)
    told: list[tuple[str, str, str]] = []
    again = SegmentStore(store.root, 1 << 30, events=DatasetEvents())
    again.events.follow(Recorder("f", told))
    again.recover(verify=False)
    assert told == [("f", "published", "ds")]
