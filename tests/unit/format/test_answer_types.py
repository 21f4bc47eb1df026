"""The typed answers of the node's ops come back off the wire as they went: for any value of
each answer type, `Rsp.from_wire(json of x.to_wire()) == x`, and the keys a handler sent as a
dict before it answered a type are the keys it sends now."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kspeedfs.format.contract import Wire, field_types
from kspeedfs.format.contract.decoded import (
    DatasetVariants,
    DecodeDropped,
    DecodeStarted,
    MemberVariants,
    VariantProgress,
    VariantSummary,
)
from kspeedfs.format.contract.node import (
    DatasetEntry,
    DatasetListing,
    LoadingEntry,
    NodeStatus,
)
from kspeedfs.format.contract.rdma import (
    RdmaConnected,
    RdmaRefused,
    RdmaSegmentTable,
)
from kspeedfs.node.store import DatasetRecord
from kspeedfs.sources.loader import Progress

ANSWERS: list[type[Wire]] = [
    VariantProgress,
    DecodeStarted,
    DecodeDropped,
    MemberVariants,
    VariantSummary,
    DatasetVariants,
    NodeStatus,
    DatasetEntry,
    LoadingEntry,
    DatasetListing,
    RdmaRefused,
    RdmaConnected,
    RdmaSegmentTable,
]

# What JSON carries where a field is typed Any (a subsystem's figures, an endpoint).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def values_of(hint: Any) -> st.SearchStrategy[Any]:
    """Values of type `hint` as a handler makes them (counts and sizes are never negative)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return JSON
    if origin in (Union, types.UnionType):
        return st.one_of([values_of(a) for a in typing.get_args(hint)])
    if origin is Literal:
        return st.sampled_from(typing.get_args(hint))
    if origin is list:
        return st.lists(values_of(typing.get_args(hint)[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), values_of(typing.get_args(hint)[1]), max_size=3)
    if isinstance(hint, type) and issubclass(hint, Wire):
        return answers_of(hint)
    scalars: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(0, 2**63),
        float: st.floats(0, 1e12, allow_nan=False),
        str: st.text(max_size=12),
    }
    return scalars[hint]


@functools.cache  # one strategy per type, not one per drawn example
def answers_of(cls: type[Wire]) -> st.SearchStrategy[Any]:
    return st.builds(cls, **{name: values_of(hint) for name, hint in field_types(cls).items()})


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda cls: cls.__name__)
@given(data=st.data())
def test_an_answer_comes_back_off_the_wire_as_it_went_with_or_without_a_newer_field(
    answer: type[Wire], data: st.DataObject
) -> None:
    """Both properties of one drawn value (drawing is most of the cost): it comes back as it
    went, and a field only a newer node sends is left out."""
    sent = data.draw(answers_of(answer))
    assert answer.from_wire(json.loads(json.dumps(sent.to_wire()))) == sent
    newer = json.loads(json.dumps({**sent.to_wire(), "from_a_newer_node": [1, "x"]}))
    assert answer.from_wire(newer) == sent


def test_a_listed_dataset_keeps_the_keys_of_its_record() -> None:
    """`list`'s entry of a published dataset: its record's keys (DatasetRecord.to_wire) and
    the ones `list` adds; where its segments are placed only when the catalog says."""
    record = DatasetRecord("d", "u" * 32, "/src", "offline", 1, 3, 30, 4096, 1.5, Path("/shm/d"))
    added = {"leases": 0, "decoded": {}}
    entry = DatasetEntry(**record.to_wire(), **added)
    assert set(entry.to_wire()) == set(record.to_wire()) | set(added)
    placed = dataclasses.replace(entry, placed=["a:1"], lost=[])
    assert placed.to_wire() == {**entry.to_wire(), "placed": ["a:1"], "lost": []}


def test_a_listed_load_keeps_the_keys_of_its_progress() -> None:
    progress = Progress(state="loading", source="/src").to_wire()
    entry = LoadingEntry(name="d", **progress)
    assert entry.to_wire() == {"name": "d", **progress}
    listing = DatasetListing.from_wire({"node": "a:1", "datasets": [entry.to_wire()]})
    assert listing.datasets == [entry]
