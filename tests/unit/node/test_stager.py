"""A preload in-process: a coordinator and two members' stagers, each over a real SegmentStore
in a temporary folder, their ops called directly (the `ask` between them is OpRegistry.call,
no socket). Each member publishes exactly the segments placement gave it, as the source has
them; a member that refuses its part leaves nothing staged or reserved anywhere."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.node import Ping, Pong
from kspeedfs.format.contract.preload import Preload
from kspeedfs.format.errors import NoSpace
from kspeedfs.node.control.static import StaticControl
from kspeedfs.node.coordinator import PreloadCoordinator
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.ops import READ, OpRegistry
from kspeedfs.node.preload_queue import PreloadQueue
from kspeedfs.node.stager import Stager
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import LocalSource
from unit.controlfakes import inline_threads, run

MEMBERS = ["a:1", "b:1"]
SEGMENT = 64 * 1024


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder in /dev/shm (the stores' filesystem), removed afterwards."""
    root = Path("/dev/shm") / f"kspeedfs-unit-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Member:
    """A member's store, stager and ops."""

    def __init__(self, address: str, root: Path, budget: int):
        self.store = SegmentStore(root / address.replace(":", "_"), budget, events=DatasetEvents())
        self.store.recover(verify=False)
        self.stager = Stager(self.store, address)
        self.ops = OpRegistry()
        self.stager.register_ops(self.ops)
        self.ops.add(Ping, self.pong, READ)
        self.address = address

    async def pong(self, request: Ping) -> Pong:
        return Pong(self.address, 1)


def source(tmp_path: Path, files: int) -> Path:
    folder = tmp_path / "source"
    folder.mkdir()
    for i in range(files):
        (folder / f"f{i:02d}").write_bytes(bytes([i + 1]) * (SEGMENT // 2 + 100 * i))
    return folder


def coordinator_over(members: dict[str, Member]) -> PreloadCoordinator:
    settings = Settings(segment_size=SEGMENT)

    async def ask(member: str, request: Request[Answer]) -> Answer:
        return await members[member].ops.call(request)

    async def after_preload(name: str, uuid: str, decoded: int) -> None:
        raise AssertionError("no decoded preload here")

    a = members["a:1"]
    return PreloadCoordinator(
        settings,
        a.store,
        LoadTable(),
        a.stager,
        StaticControl(settings, MEMBERS),
        ask,
        after_preload,
        PreloadQueue(a.store.budgets),
    )


async def preload(coordinator: PreloadCoordinator, request: Preload) -> str:
    """The preload's final state (ready, or failed)."""
    await coordinator.op_preload(request)
    return await settled(coordinator, request.name)


async def settled(coordinator: PreloadCoordinator, name: str) -> str:
    """The final state (ready, or failed) of the load of `name` under way."""
    while (progress := coordinator.loads.get(name)) is not None:
        if progress.state == "failed":
            return "failed"
        await trio.sleep(0.05)  # polling the load table
    return "ready"


async def in_queue(coordinator: PreloadCoordinator, name: str) -> None:
    """Wait until `name` waits in the coordinator's queue, refused there at least once."""
    while not any(w.name == name and w.reason for w in coordinator.queue.status()):
        await trio.sleep(0.01)  # polling the queue


def test_each_member_publishes_the_segments_placed_on_it(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline_threads(monkeypatch)
    folder = source(tmp_path, 12)
    members = {m: Member(m, shm, 1 << 30) for m in MEMBERS}
    coordinator = coordinator_over(members)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for m in members.values():
                await nursery.start(m.stager.run)
            await nursery.start(coordinator.run)
            request = Preload(name="ds", source=str(folder), replicas=1)
            assert await preload(coordinator, request) == "ready"
            nursery.cancel_scope.cancel()

    run(main)
    records = {m: member.store.datasets["ds"] for m, member in members.items()}
    assert len({r.uuid for r in records.values()}) == 1  # one instance everywhere
    segments = records["a:1"].segments
    assert segments > 2
    assert sorted(s for r in records.values() for s in r.held) == list(range(segments))
    src = LocalSource(str(folder))
    for m, member in members.items():
        ds = member.store.open("ds")
        for seg in records[m].held:
            want = bytes(src.read_segment(ds.manifest, ds.manifest.layout, seg))
            assert bytes(ds.segment(seg)) == want, (m, seg)
        assert member.stager.stages == {}


def test_a_member_that_refuses_its_part_leaves_nothing_anywhere(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline_threads(monkeypatch)
    folder = source(tmp_path, 12)
    members = {"a:1": Member("a:1", shm, 1 << 30), "b:1": Member("b:1", shm, 4096)}
    coordinator = coordinator_over(members)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for m in members.values():
                await nursery.start(m.stager.run)
            await nursery.start(coordinator.run)
            with pytest.raises(NoSpace):
                await coordinator.op_preload(Preload(name="ds", source=str(folder)))
            nursery.cancel_scope.cancel()

    run(main)
    for m, member in members.items():
        assert member.store.datasets == {}, m
        assert member.store.budgets.reserved == {}, m  # every claim given back
        assert member.stager.stages == {} and member.stager.claims == {}, m


def test_a_queued_preload_waits_for_room_and_starts_when_an_unload_frees_it(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members with room for one of two datasets: the second, queued, waits (state
    "queued", first in the queue, nothing claimed) and loads once the first is unloaded; a
    third, not queued, is refused as before; an unload of a queued one cancels it."""
    inline_threads(monkeypatch)
    first, second = tmp_path / "one", tmp_path / "two"
    for folder in (first, second):
        folder.mkdir()
        for i in range(6):
            (folder / f"f{i}").write_bytes(bytes([i + 1]) * (SEGMENT - 4096))
    members = {m: Member(m, shm, 4 * SEGMENT) for m in MEMBERS}
    coordinator = coordinator_over(members)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for m in members.values():
                await nursery.start(m.stager.run)
            await nursery.start(coordinator.run)
            assert await preload(coordinator, Preload(name="one", source=str(first))) == "ready"
            with pytest.raises(NoSpace, match="held by one"):
                await coordinator.op_preload(Preload(name="no", source=str(second)))
            started = await coordinator.op_preload(
                Preload(name="two", source=str(second), queue=True)
            )
            assert started.queued == 1
            await in_queue(coordinator, "two")
            progress = coordinator.loads.get("two")
            assert progress is not None and progress.state == "queued"
            (waiting,) = coordinator.queue.status()
            assert waiting.name == "two" and waiting.position == 1
            assert waiting.short_by and "held by one" in waiting.reason
            for member in members.values():  # nothing of "two" claimed while it waits
                assert not any("two" in k for k in member.store.budgets.reserved)
            for member in members.values():
                member.store.unload("one")
            assert await settled(coordinator, "two") == "ready"
            assert coordinator.queue.status() == []
            # A queued preload that an unload cancels: failed, out of the queue.
            await coordinator.op_preload(Preload(name="three", source=str(first), queue=True))
            await in_queue(coordinator, "three")
            waiting = coordinator.loads.get("three")
            assert waiting is not None and waiting.state == "queued"
            waiting.cancel.set()  # what an unload of it does
            assert await settled(coordinator, "three") == "failed"
            assert coordinator.queue.status() == []
            nursery.cancel_scope.cancel()

    run(main)
    for member in members.values():
        assert set(member.store.datasets) == {"two"}
