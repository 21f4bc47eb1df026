"""The registry's bookkeeping: rkeys live exactly as long as the dataset's registration."""

from __future__ import annotations

import threading
import uuid

import pytest
from rdmafakes import FakeRegistrar

from kspeedfs.format.errors import DataError
from kspeedfs.rdma.registry import SegmentRegistry


def segments(n: int, size: int = 100) -> dict[int, bytes]:
    return {k: bytes([k]) * size for k in range(n)}


def test_register_publishes_one_key_per_segment_and_deregister_revokes_them() -> None:
    fake = FakeRegistrar()
    reg = SegmentRegistry(fake)
    u = uuid.uuid4().hex
    table = reg.register("ds", u, 4, {0: b"a" * 10, 2: b"c" * 30, 3: b""})
    assert table is not None
    assert table.uuid == u and len(table.keys) == 4
    # Held segments readable with their keys; not-held and empty ones have no key.
    assert fake.read(*table.locate(0, 0, 10), 10) == b"a" * 10
    assert fake.read(*table.locate(2, 5, 20), 20) == b"c" * 20
    assert table.keys[1].length == 0 and table.keys[3].length == 0
    assert reg.table("ds") == table
    assert reg.statistics() == {"datasets": 1, "regions": 2, "bytes": 40}

    assert reg.deregister("ds") is True
    assert reg.table("ds") is None
    assert fake.live == {}
    assert all(r.closed for r in fake.made)
    assert fake.read(*table.locate(0, 0, 10), 10) is None  # the old key is refused
    assert reg.deregister("ds") is False
    assert reg.statistics() == {"datasets": 0, "regions": 0, "bytes": 0}


def test_same_dataset_registers_once_and_a_reload_gets_new_keys() -> None:
    fake = FakeRegistrar()
    reg = SegmentRegistry(fake)
    first = reg.register("ds", "aa" * 16, 2, segments(2))
    assert first is not None
    assert reg.register("ds", "aa" * 16, 2, segments(2)) is first
    assert len(fake.made) == 2
    # Reloaded under the same name: the old registration goes, keys and generation change.
    second = reg.register("ds", "bb" * 16, 2, segments(2))
    assert second is not None
    assert second.generation != first.generation
    assert {k.rkey for k in second.keys}.isdisjoint(k.rkey for k in first.keys)
    assert [r.closed for r in fake.made] == [True, True, False, False]


def test_a_failed_registration_leaves_nothing_registered() -> None:
    fake = FakeRegistrar()
    fake.fail_after = 2
    reg = SegmentRegistry(fake)
    with pytest.raises(DataError, match="locked-memory"):
        reg.register("ds", "aa" * 16, 5, segments(5))
    assert fake.live == {}
    assert reg.table("ds") is None
    with pytest.raises(DataError, match="out of range"):
        SegmentRegistry(FakeRegistrar()).register("ds", "aa" * 16, 2, {2: b"x"})


def test_an_unload_during_registration_wins() -> None:
    fake = FakeRegistrar()
    reg = SegmentRegistry(fake)
    calls = 0

    def unload_midway() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            reg.deregister("ds")  # what the unload does while registration is pinning

    fake.on_register = unload_midway
    assert reg.register("ds", "aa" * 16, 3, segments(3)) is None
    assert reg.table("ds") is None
    assert fake.live == {}, "a registration that lost the race must not stay pinned"


def test_an_unload_between_lookup_and_registration_wins() -> None:
    fake = FakeRegistrar()
    reg = SegmentRegistry(fake)
    epoch = reg.epoch("ds")  # read before the dataset was looked up
    reg.deregister("ds")  # then unloaded
    assert reg.register("ds", "aa" * 16, 1, segments(1), epoch=epoch) is None
    assert fake.made == []
    assert reg.register("ds", "aa" * 16, 1, segments(1), epoch=reg.epoch("ds")) is not None


def test_concurrent_registrations_of_one_dataset_pin_it_once() -> None:
    fake = FakeRegistrar()
    reg = SegmentRegistry(fake)
    gate = threading.Event()
    fake.on_register = lambda: None if gate.wait() else None
    results: list[object] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(reg.register("ds", "aa" * 16, 3, segments(3)))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert results[0] is results[1] is not None
    assert len(fake.made) == 3


def test_close_deregisters_everything() -> None:
    fake = FakeRegistrar()
    reg = SegmentRegistry(fake)
    reg.register("a", "aa" * 16, 2, segments(2))
    reg.register("b", "bb" * 16, 1, segments(1))
    reg.close()
    assert fake.live == {} and reg.names() == []
