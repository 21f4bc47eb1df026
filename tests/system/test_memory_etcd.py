"""tests/unit's MemoryEtcd checked against a real etcd: one script of ClusterState calls
(registrations, claims, fenced and guarded updates, down notes, a revoke, snapshots) gives the
same answers, revisions included, over both. The unit tests of the control plane are only as
true as this fake."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from unit.controlfakes import ETCD_URL, MemoryEtcd, MemoryEtcdClient

from kspeedfs.client.catalog import CatalogEntry
from kspeedfs.client.clusterstate import ClusterState, absent, mod_is
from kspeedfs.format.errors import AlreadyExists, Fenced, KSpeedError
from kspeedfs.testing.etcd import EtcdProcess


def outcome(call: Any) -> Any:
    """What a call answered, or the kind of error it raised."""
    try:
        return call()
    except KSpeedError as e:
        return type(e).__name__


def view(state: ClusterState) -> dict[str, Any]:
    """A snapshot without the wall-clock fields (they differ between two runs)."""
    snap = state.snapshot()
    return {
        "revision": snap.revision,
        "members": {m: (k.create, k.mod) for m, k in snap.members.items()},
        "known": sorted(snap.known),
        "down": {m: (k.create, k.mod, k.value["by"]) for m, k in snap.down.items()},
        "grace": sorted(snap.grace),
        "datasets": snap.datasets,
    }


def script(state: ClusterState) -> list[Any]:
    seen: list[Any] = []
    a = state.register("a:1", 30, 1)
    b = state.register("b:1", 30, 2)
    seen += [(a.address, a.revision), (b.address, b.revision), view(state)]
    record = CatalogEntry("ds", "u1", "loading", members=("a:1", "b:1"))
    seen.append(outcome(lambda: state.claim(record, a)))
    seen.append(outcome(lambda: state.claim(dataclasses.replace(record, uuid="u2"), b)))
    ready = state.update("ds", "u1", lambda r: dataclasses.replace(r, state="ready"), fence=a)
    seen += [ready, state.update("ds", "other", lambda r: r), view(state)]
    # c never joined: noted down (no grace), once; not over a live member.
    seen.append(state.note_down("c:1", a, 0))
    seen.append(state.note_down("c:1", a, 0))
    seen.append(state.note_down("b:1", a, 0))
    seen.append(view(state))
    down_mod = state.snapshot().down["c:1"].mod
    prefix = state.prefix
    guard_ok = [absent(prefix + "members/c:1"), mod_is(prefix + "down/c:1", down_mod)]
    guard_bad = [mod_is(prefix + "down/c:1", down_mod + 1)]
    seen.append(
        state.update("ds", "u1", lambda r: dataclasses.replace(r, lost=("c:1",)), guard=guard_ok)
    )
    seen.append(
        state.update("ds", "u1", lambda r: dataclasses.replace(r, lost=()), guard=guard_bad)
    )
    # b leaves: its key goes at once, and its catalog writes are fenced.
    state.revoke(b.lease)
    seen.append(outcome(lambda: state.update("ds", "u1", lambda r: r, fence=b)))
    seen += [state.keep_alive(a.lease), state.keep_alive(b.lease), view(state)]
    seen.append(state.member_table())
    seen += [state.remove("ds", "u1"), state.remove("ds", "u1"), view(state)]
    state.forget("c:1")
    seen.append(view(state))
    return seen


def without_times(rows: list[Any]) -> list[Any]:
    return [
        [{k: v for k, v in row.items() if k != "since"} for row in item]
        if isinstance(item, list) and item and isinstance(item[0], dict)
        else item
        for item in rows
    ]


def test_memory_etcd_answers_as_etcd_does(
    etcd: EtcdProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = without_times(script(ClusterState([etcd.endpoint], "contract")))
    fake = MemoryEtcd(clock=time.monotonic)
    monkeypatch.setattr("etcd3gw.Etcd3Client", lambda **kw: MemoryEtcdClient(fake, **kw))
    memory = without_times(script(ClusterState([ETCD_URL], "contract")))
    for step, (want, got) in enumerate(zip(real, memory, strict=True)):
        assert got == want, f"step {step}"
    assert AlreadyExists.__name__ in real and Fenced.__name__ in real  # the refusals ran
