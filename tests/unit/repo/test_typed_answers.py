"""Ops answer typed Wire types (issue 31): each answer comes back off the wire equal to what was
sent, every handler a node registers is annotated to answer one, not a dict, each request names
that answer, and no caller decodes an answer itself (issue 42)."""

from __future__ import annotations

import ast
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Request, Wire, answer_hint, field_types
from kspeedfs.format.contract.decoded import DatasetVariants, DecodeStatus, MemberVariants
from kspeedfs.format.contract.metaindexes import (
    IndexAddAborted,
    IndexAdded,
    IndexCommitted,
    IndexPiecePut,
    IndexPieceStaged,
    IndexReserved,
    MetaAdded,
)
from kspeedfs.format.contract.pieces import BlobPiece
from kspeedfs.format.contract.preload import (
    Aborted,
    Checksummed,
    Committed,
    LoadProgress,
    ManifestPieceTaken,
    ManifestPlaced,
    Progressing,
    Published,
    PushStaged,
    SegmentPiecePut,
    StageClaimed,
    StageManifest,
    StageStarted,
)
from kspeedfs.format.contract.rdma import RdmaConnect, RdmaRefused, RdmaSegments, RdmaSegmentTable
from kspeedfs.format.contract.status import (
    CacheStatus,
    ControlStatus,
    DiskTierStatus,
    IntegrityStatus,
    LocalSocketStatus,
    QueuedPreload,
    RdmaStatus,
)
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.node.loads import progressing
from kspeedfs.node.ops import OpRegistry
from kspeedfs.node.server import NodeServer
from kspeedfs.node.store import DatasetRecord
from kspeedfs.sources.loader import Progress

ANSWERS: list[type[Wire]] = [
    StageClaimed,
    StageStarted,
    SegmentPiecePut,
    PushStaged,
    Progressing,
    Published,
    ManifestPieceTaken,
    ManifestPlaced,
    Committed,
    Aborted,
    IndexPieceStaged,
    IndexAdded,
    MetaAdded,
    IndexReserved,
    IndexPiecePut,
    IndexCommitted,
    IndexAddAborted,
    Checksummed,
    DiskTierStatus,
    IntegrityStatus,
    LocalSocketStatus,
    RdmaStatus,
    CacheStatus,
    ControlStatus,
    QueuedPreload,
]


U32 = st.integers(min_value=0, max_value=2**32 - 1)
U64 = st.integers(min_value=0, max_value=2**64 - 1)


def values(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a field of type `hint` that its checks pass (the answers' numbers are counts,
    sizes and times: none is below 0)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else values(a) for a in get_args(hint)))
    if origin is Literal:
        return st.sampled_from(get_args(hint))
    if origin is list:
        return st.lists(values(get_args(hint)[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), values(get_args(hint)[1]), max_size=4)
    if isinstance(hint, type) and issubclass(hint, Wire):
        return answers(hint)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        bool: st.booleans(),
        int: U64,
        float: st.floats(min_value=0, allow_nan=False, allow_infinity=False),
        str: st.text(max_size=20),
    }
    return simple[hint]


def answers(kind: type[Wire]) -> st.SearchStrategy[Any]:
    if kind is Checksummed:  # its columns in base64, made by the pieces codec
        return st.builds(Checksummed.of, st.dictionaries(U32, U64), st.dictionaries(U32, U64))
    fields = {name: values(hint) for name, hint in field_types(kind).items()}
    return st.fixed_dictionaries(fields).map(lambda kw: kind(**kw))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ANSWERS).flatmap(answers))
def test_an_answer_comes_back_off_the_wire_as_it_was_sent(answer: Wire) -> None:
    wire = json.loads(json.dumps(answer.to_wire()))
    assert type(answer).from_wire(wire) == answer


def test_a_checksummed_answer_gives_its_columns_back() -> None:
    answer = Checksummed.from_wire(Checksummed.of({7: 2**64 - 1, 3: 5}, {0: 9}).to_wire())
    files, sums = answer.columns
    assert (files.tolist(), sums.tolist(), answer.segments) == ([3, 7], [5, 2**64 - 1], {"0": 9})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"files": "***"}, "stage_result files is not base64"),
        ({"files": "AAA="}, "not a whole number of <u4 values"),
        ({"sums": ""}, "1 files but 0 sums"),
    ],
)
def test_a_checksummed_answer_with_bad_columns_is_refused(
    change: dict[str, Any], message: str
) -> None:
    wire = {**Checksummed.of({1: 2}, {}).to_wire(), **change}
    with pytest.raises(InvalidArgument, match=message):
        Checksummed.from_wire(wire)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> OpRegistry:
    """The ops of a node built with etcd (the control plane's too); nothing is started."""
    tmp = tmp_path_factory.mktemp("ops")
    node = Settings(
        shm_dir=tmp / "shm", token_file=tmp / "token", transport="tcp", etcd=["http://127.0.0.1:9"]
    )
    return NodeServer(node).ops


def answered(hint: Any) -> tuple[Any, ...]:
    """The types a handler's return annotation names (each one of a union)."""
    return get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)


def test_every_handler_answers_a_wire_type(registry: OpRegistry) -> None:
    """No handler answers a dict (issue 31): each names the Wire types it answers."""
    dicts = set()
    for name in registry.names():
        hint = typing.get_type_hints(registry.get(name).handler)["return"]
        kinds = answered(hint)
        if any(k is dict or get_origin(k) is dict for k in kinds):
            dicts.add(name)
        else:
            assert all(isinstance(k, type) and issubclass(k, Wire) for k in kinds), (name, hint)
    assert not dicts, f"handlers answering a dict: {sorted(dicts)}"


def test_each_answer_type_is_frozen() -> None:
    for kind in ANSWERS:
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind


def test_progress_answers_carry_the_keys_they_always_had(tmp_path: Path) -> None:
    """`progress` and `stage_status` answer a load's counts or a published dataset's record,
    with its version: the keys of Progress.to_wire and DatasetRecord.to_wire, as before."""
    assert list(field_types(Progressing)) == [*Progress().to_wire(), "version"]
    record = DatasetRecord("d", "u", "/src", "offline", 1, 2, 3, 4, 5.0, tmp_path)
    assert list(field_types(Published)) == [*record.to_wire(), "version"]


def test_every_request_names_the_answer_its_handler_gives(registry: OpRegistry) -> None:
    """A call returns the request's own answer type (Request["Answer"]): the one its op's
    handler is annotated to answer, each type of a union."""
    wrong = {}
    for name in registry.names():
        op = registry.get(name)
        handler = set(answered(typing.get_type_hints(op.handler)["return"]))
        named = set(answered(answer_hint(op.request)))
        if handler != named:
            wrong[name] = (sorted(t.__name__ for t in named), sorted(t.__name__ for t in handler))
    assert not wrong, f"requests naming another answer than their handler's (named, given): {wrong}"


@pytest.mark.parametrize(
    ("request_", "answer"),
    [
        (LoadProgress(name="d"), progressing(Progress(state="loading", source="/s"))),
        (StageManifest(name="d", uuid="u", piece=BlobPiece(0, 0, "")), ManifestPlaced(node="a")),
        (
            StageManifest(name="d", uuid="u", piece=BlobPiece(0, 0, "")),
            ManifestPieceTaken(node="a", received=3),
        ),
        (RdmaConnect(endpoint={}), RdmaRefused(reason="no device")),
        (RdmaSegments(name="d"), RdmaRefused(reason="no device")),
        (RdmaSegments(name="d"), RdmaSegmentTable(uuid="u", table="t")),
        (DecodeStatus(name="d", local=True), MemberVariants(node="a", variants={})),
        (DecodeStatus(name="d"), DatasetVariants(name="d", uuid="u", nodes={}, variants={})),
    ],
)
def test_a_request_answered_by_one_of_several_types_tells_them_apart(
    request_: Request[Any], answer: Wire
) -> None:
    assert request_.answer(json.loads(json.dumps(answer.to_wire()))) == answer


ROOT = Path(__file__).resolve().parents[3]


def test_no_caller_decodes_an_answer_itself(registry: OpRegistry) -> None:
    """An answer is decoded in one place (Request.answer, from the type its request names):
    no code outside kspeedfs/format/contract calls an op's answer type's `from_wire`."""
    answers: set[str] = set()
    for name in registry.names():
        hint = typing.get_type_hints(registry.get(name).handler)["return"]
        answers.update(t.__name__ for t in answered(hint))
    contract = ROOT / "kspeedfs" / "format" / "contract"
    found = []
    for package in ("kspeedfs", "mountd", "pytorch_ext"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if contract in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_wire"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in answers
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.value.id}")
    assert not found, f"callers decoding an answer themselves (call returns it typed): {found}"
