"""The preload coordinator in-process, up to its admission: members and claims from a real
ControlPlane over an in-memory etcd (or the static one), the members' answers from a fake
`ask`. A job's preload is held to source_roots and a lease; members that do not answer are left
out; of two preloads of one name one wins; a preload a member refuses is rolled back on every
member and its claim removed."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.client.clusterstate import ClusterState
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Request
from kspeedfs.format.contract.node import Ping
from kspeedfs.format.contract.preload import Abort, Preload, StageClaim
from kspeedfs.format.errors import AlreadyExists, AuthError, NodeUnreachable, NoSpace
from kspeedfs.node.budget import Budgets
from kspeedfs.node.control import ControlPlane, EtcdCatalog
from kspeedfs.node.control.membership import Membership
from kspeedfs.node.control.static import StaticControl
from kspeedfs.node.coordinator import PreloadCoordinator
from kspeedfs.node.loads import LoadTable
from kspeedfs.node.ops import JOB, caller_role
from kspeedfs.node.preload_queue import PreloadQueue
from unit.controlfakes import ETCD_URL, MemoryEtcd, run

MEMBERS = ["a:1", "b:1", "c:1"]
PREFIX = "/kspeedfs/unit/"


def settings(**more: Any) -> Settings:
    return Settings(etcd=[ETCD_URL], cluster="unit", member_ttl=3.0, **more)


class Members:
    """The other members' answers: Ping from those up, StageClaim refused by `full`, the
    rest (rollback's Abort and UnloadLocal) answered empty; every request kept in `asked`."""

    def __init__(self, down: frozenset[str] = frozenset(), full: frozenset[str] = frozenset()):
        self.down, self.full = down, full
        self.asked: list[tuple[str, Request]] = []

    async def ask(self, member: str, request: Request) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        self.asked.append((member, request))
        if member in self.down:
            raise NodeUnreachable(f"{member} does not answer")
        if isinstance(request, StageClaim) and member in self.full:
            raise NoSpace(f"{member}: no room for {request.name}")
        return {}

    def ops(self, kind: type[Request]) -> list[str]:
        return [m for m, r in self.asked if isinstance(r, kind)]


def coordinator(control: Any, members: Members, tmp_path: Path, **more: Any) -> PreloadCoordinator:
    store = SimpleNamespace(datasets={}, staging_dir=tmp_path / "staging")
    stager = SimpleNamespace(address="a:1")
    return PreloadCoordinator(
        settings(**more),
        store,  # type: ignore[arg-type]
        LoadTable(),
        stager,  # type: ignore[arg-type]
        control,
        members.ask,
        after_preload=None,  # type: ignore[arg-type]
        queue=PreloadQueue(Budgets(tmp_path, 1 << 30, {})),
    )


def source(tmp_path: Path) -> Path:
    folder = tmp_path / "roots" / "data"
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"f{i}").write_bytes(b"x" * 1000)
    return folder


async def etcd_control(address: str = "a:1") -> ControlPlane:
    """This node's control plane, joined, with the other members live in etcd."""
    control = ControlPlane(settings(), None, None, None, EtcdCatalog.of(settings(), None))  # type: ignore[arg-type]
    await control.membership.join(address)
    for other in MEMBERS:
        if other != address:
            await Membership(settings(), ClusterState.of(settings())).join(other)
    return control


def test_a_job_preload_is_held_to_source_roots_and_a_lease(tmp_path: Path) -> None:
    data = source(tmp_path)
    (data / "escape").symlink_to(tmp_path)  # a link out of the root does not count
    roots = [str(tmp_path / "roots")]
    members = Members()

    async def main() -> None:
        caller_role.set(JOB)
        none_allowed = coordinator(StaticControl(settings(), MEMBERS), members, tmp_path)
        with pytest.raises(AuthError, match="source_roots"):
            await none_allowed.op_preload(Preload(name="ds", source=str(data)))
        held = coordinator(
            StaticControl(settings(), MEMBERS), members, tmp_path, source_roots=roots
        )
        for refused in (
            Preload(name="ds", source=str(data), lifetime="offline"),
            Preload(name="ds", source=str(tmp_path)),
            Preload(name="ds", source=str(data / "escape")),
            Preload(name="ds", source="relative/path"),
        ):
            with pytest.raises(AuthError):
                await held.op_preload(refused)
        assert members.asked == []  # refused before any member was asked anything
        assert held.loads.get("ds") is None

    run(main)


def test_members_that_do_not_answer_are_left_out(tmp_path: Path) -> None:
    members = Members(down=frozenset({"b:1"}))

    async def main() -> None:
        c = coordinator(StaticControl(settings(), MEMBERS), members, tmp_path)
        assert await c.live_members() == ["a:1", "c:1"]
        assert sorted(members.ops(Ping)) == MEMBERS

    run(main)


def test_a_preload_a_member_refuses_is_rolled_back_everywhere_and_unclaimed(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    data = source(tmp_path)
    members = Members(full=frozenset({"b:1"}))

    async def main() -> None:
        c = coordinator(await etcd_control(), members, tmp_path)
        with pytest.raises(NoSpace):
            await c.op_preload(Preload(name="ds", source=str(data)))
        assert sorted(members.ops(Abort)) == MEMBERS  # every member's part rolled back
        assert not etcd.has(PREFIX + "datasets/ds")  # the claim removed: the name is free
        assert c.loads.get("ds") is None  # and not shown as loading here

    run(main)


def test_of_two_preloads_of_one_name_one_wins(etcd: MemoryEtcd, tmp_path: Path) -> None:
    data = source(tmp_path)
    members = Members()

    async def main() -> None:
        control = await etcd_control()
        other = Membership(settings(), ClusterState.of(settings()))
        await other.join("b:1")
        await other.claim(CatalogEntry("ds", "first", "loading"))
        c = coordinator(control, members, tmp_path)
        with pytest.raises(AlreadyExists):
            await c.op_preload(Preload(name="ds", source=str(data)))
        assert members.ops(StageClaim) == []  # nothing staged for the loser
        assert etcd.value(PREFIX + "datasets/ds")["uuid"] == "first"  # the winner's claim stays

    run(main)


def test_a_dataset_loaded_here_already_is_refused(tmp_path: Path) -> None:
    members = Members()

    async def main() -> None:
        c = coordinator(StaticControl(settings(), MEMBERS), members, tmp_path)
        c.store.datasets["ds"] = object()
        with pytest.raises(AlreadyExists):
            await c.op_preload(Preload(name="ds", source=os.fspath(tmp_path)))
        assert members.asked == []

    run(main)
