"""The catalog's entry typed (CatalogEntry): parsed once where ClusterState reads etcd, written
once where it writes, with the JSON in etcd key for key what nodes of older versions write and
read; a malformed entry is logged on one line and left out, never raised."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.client.catalog import CatalogEntry, ListedInstance
from kspeedfs.client.clusterstate import ClusterState
from unit.controlfakes import ETCD_URL, MemoryEtcd

PREFIX = "/kspeedfs/unit/"

# A preload's claim as today's code writes it (control.loading_record), in its key order.
CLAIMED: dict[str, Any] = {
    "name": "imagenet",
    "uuid": "3f2a9c0e5b7d4e1fa0c2b4d6e8f01234",
    "state": "loading",
    "source": "s3://bucket/imagenet/",
    "endpoint": "https://s3.example.com",
    "lifetime": "offline",
    "replicas": 2,
    "members": ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"],
    "segment_size": 67108864,
    "segments": 211,
    "files": 1281167,
    "bytes": 14145391234,
    "coordinator": "10.0.0.1:7000",
    "created": 1764720000.123456,
}
# The same record after a heal declared a member lost ({**r, "lost": [...]}).
HEALED = {**CLAIMED, "state": "ready", "lost": ["10.0.0.3:7000"]}


def state() -> ClusterState:
    return ClusterState([ETCD_URL], "unit")


@pytest.fixture(autouse=True)
def outside_trio(etcd: MemoryEtcd) -> None:
    """These tests call ClusterState outside trio: leases run on the monotonic clock."""
    etcd.clock = time.monotonic


def test_an_entry_written_by_todays_code_parses_and_is_written_back_byte_for_byte() -> None:
    for written in (CLAIMED, HEALED):
        entry = CatalogEntry.from_json(json.loads(json.dumps(written)))
        assert json.dumps(entry.to_json()) == json.dumps(written)
    entry = CatalogEntry.from_json(HEALED)
    assert entry.ready and entry.members[1] == "10.0.0.2:7000" and entry.bytes == 14145391234
    assert entry.lost == ("10.0.0.3:7000",) and CatalogEntry.from_json(CLAIMED).lost is None


def test_an_entry_round_trips_through_its_json() -> None:
    entry = CatalogEntry("ds", "u1", "ready", members=("a:1", "b:1"), created=1.5, lost=())
    assert CatalogEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry


def test_keys_of_a_newer_writer_are_kept_and_missing_ones_read_as_before() -> None:
    newer = {**CLAIMED, "colour": {"any": ["json"]}}
    entry = CatalogEntry.from_json(newer)
    assert entry.extra == {"colour": {"any": ["json"]}}
    assert entry.to_json() == newer
    old = CatalogEntry.from_json({"name": "ds", "uuid": "u1", "state": "ready"})
    assert (old.endpoint, old.replicas, old.members, old.lost_members) == ("", 1, (), ())
    assert "created" not in old.to_json() and "lost" not in old.to_json()


def test_a_listed_read_through_instance_writes_what_todays_publish_wrote() -> None:
    listed = ListedInstance("u2", ("a:1",), 3, 10, 4096, 1024, 2.5)
    today = {  # {**r, **catalog_fields(meta), "state": "ready"}
        **CLAIMED,
        "uuid": "u2",
        "members": ["a:1"],
        "segments": 3,
        "files": 10,
        "bytes": 4096,
        "segment_size": 1024,
        "created": 2.5,
        "lost": [],
        "state": "ready",
    }
    written = CatalogEntry.from_json(CLAIMED).listed(listed).to_json()
    assert json.dumps(written) == json.dumps(today)


def test_claim_and_update_write_the_json_of_the_entry(etcd: MemoryEtcd) -> None:
    s = state()
    me = s.register("a:1", 10, 1)
    s.claim(CatalogEntry.from_json(CLAIMED), me)
    assert etcd.keys[(PREFIX + "datasets/imagenet").encode()].value == json.dumps(CLAIMED).encode()
    heal = {**CLAIMED, "lost": ["10.0.0.3:7000"]}
    assert s.update("imagenet", CLAIMED["uuid"], lambda r: CatalogEntry.from_json(heal))
    assert etcd.value(PREFIX + "datasets/imagenet") == heal
    assert s.dataset("imagenet") == (CatalogEntry.from_json(heal), etcd.revision)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"{not json", "malformed etcd value"),
        (json.dumps({**CLAIMED, "segments": "211"}).encode(), "'segments' is not an integer"),
        (json.dumps({**CLAIMED, "members": "a:1"}).encode(), "'members' is not a list"),
        (json.dumps({**CLAIMED, "state": "failed"}).encode(), "neither loading nor ready"),
        (json.dumps({k: v for k, v in CLAIMED.items() if k != "uuid"}).encode(), "no 'uuid'"),
        (json.dumps([CLAIMED]).encode(), "not a JSON object"),
    ],
)
def test_a_malformed_entry_is_logged_on_one_line_and_left_out(
    etcd: MemoryEtcd, caplog: pytest.LogCaptureFixture, raw: bytes, why: str
) -> None:
    etcd.put(PREFIX + "datasets/good", {**CLAIMED, "name": "good"})
    etcd.put_raw(PREFIX + "datasets/bad", raw)
    s = state()
    with caplog.at_level(logging.WARNING):
        assert list(s.snapshot().datasets) == ["good"]
        assert list(s.datasets()) == ["good"] and s.dataset("bad") is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and all(why in m and "datasets/bad" in m for m in said), said
    assert all("\n" not in m for m in said)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from([*CLAIMED, "lost"]) | st.text(max_size=8)
# Today's record with some of its keys dropped or given any JSON, and objects of any keys.
OBJECTS = st.builds(
    lambda drop, changed: {**{k: v for k, v in CLAIMED.items() if k not in drop}, **changed},
    st.sets(st.sampled_from(list(CLAIMED))),
    st.dictionaries(KEYS, JSON, max_size=3),
) | st.dictionaries(KEYS, JSON, max_size=6)


NAMES = st.text("abcxyz-.", min_size=1, max_size=6)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.dictionaries(NAMES, OBJECTS, max_size=4),
    raws=st.dictionaries(NAMES, st.binary(max_size=24), max_size=2),
)
def test_no_json_object_under_datasets_raises_out_of_a_read(
    etcd: MemoryEtcd, entries: dict[str, dict[str, Any]], raws: dict[str, bytes]
) -> None:
    etcd.keys.clear()
    for name, value in entries.items():
        etcd.put(PREFIX + "datasets/" + name, value)
    for name, raw in raws.items():  # any bytes, JSON or not
        etcd.put_raw(PREFIX + "datasets/raw" + name, raw)
    s = state()
    snap = s.snapshot()
    found = s.datasets()
    assert set(snap.datasets) == set(found)
    assert {n for n in found if not n.startswith("raw")} <= set(entries)
    for name, value in entries.items():
        got = s.dataset(name)
        assert (got is None) == (name not in found)
        if got is not None:  # parsed: written back with every key and value it was read with
            written = got[0].to_json()
            assert {k: written[k] for k in value} == value
    s.member_table()
