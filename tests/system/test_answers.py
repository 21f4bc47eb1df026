"""Every op ends in an answer: a source the node cannot scan and a malformed request to any
registered op get a one-line error reply, and the node keeps serving."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import NodeProcess, make_tree, node_in, run_cli
from uidutil import NOBODY, as_user

from kspeedfs.format import contract
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Request
from kspeedfs.format.errors import InternalError, InvalidArgument, KSpeedError, NoSpace
from kspeedfs.node.ops import READ, OpRegistry
from kspeedfs.node.server import NodeServer
from kspeedfs.sources.scan import scan_tree

DATASET = "held"


@dataclasses.dataclass
class World:
    tmp: Path
    src: Path
    node: NodeProcess
    uuid: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One node holding one dataset, for a whole module of requests."""
    tmp = tmp_path_factory.mktemp("answers")
    with node_in(tmp) as node:
        src = make_tree(tmp / "src")
        done = run_cli("preload", str(src), "--name", DATASET, "-q", env=node.env())
        assert done.returncode == 0, done.stderr
        yield World(tmp, src, node, node.request("progress", name=DATASET)["uuid"])


def assert_one_line_error(done: subprocess.CompletedProcess[str], code: int, fragment: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kspeedfs: "), done.stderr
    assert fragment in lines[0], lines[0]


def assert_serves_without_traceback(world: World, refused: str) -> None:
    assert world.node.request("progress", name=DATASET)["state"] == "ready"
    assert "Traceback" not in world.node.log()
    names = [d["name"] for d in world.node.request("list")["datasets"]]
    assert refused not in names, names  # nothing left behind, failed or not


def deep_tree(root: Path, depth: int) -> Path:
    """A tree `depth` folders of 200 characters deep, made relative to each parent's
    descriptor (no path of it fits in PATH_MAX), with a file at the bottom."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d" * 200, dir_fd=fd)
            child = os.open("d" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open("leaf.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"at the bottom")
        os.close(leaf)
    finally:
        os.close(fd)
    return root


def test_a_source_deeper_than_path_max_is_a_one_line_error(world: World) -> None:
    src = deep_tree(world.tmp / "deep", depth=25)  # 25 x 201 bytes > 4096
    done = run_cli("preload", str(src), "--name", "deep", env=world.node.env())
    assert_one_line_error(done, 5, "longer than 4096 bytes")
    assert_serves_without_traceback(world, "deep")


def test_a_folder_the_scanner_cannot_read_is_a_one_line_error(public_dir: Path) -> None:
    """Scanned as an unprivileged uid (root reads every folder): a subfolder it may not list
    is refused in one line naming it, exit 5, not an OSError."""
    src = public_dir / "src"
    (src / "open").mkdir(parents=True)
    (src / "open" / "a.bin").write_bytes(b"a")
    (src / "closed").mkdir(mode=0o700)
    src.chmod(0o755)

    def scan() -> list[Any]:
        try:
            scan_tree(src)
        except KSpeedError as e:
            return [type(e).__name__, e.exit_code, str(e)]
        return []

    kind, code, message = as_user(NOBODY, [], scan)
    assert (kind, code) == ("InvalidArgument", 5), message
    assert message == f"source is not readable: {src}/closed: Permission denied"


def node_registry() -> OpRegistry:
    settings = Settings(shm_dir=Path("/nonexistent/shm"), token_file=Path("/nonexistent/t"))
    return NodeServer(dataclasses.replace(settings, transport="tcp")).ops


def registered_ops() -> list[str]:
    """The ops a node registers (read off the registry, so a new op is covered here)."""
    return node_registry().names()


def typed_ops() -> list[tuple[str, type[Request]]]:
    """Every op with its request type (every op has one)."""
    ops = node_registry()
    return [(name, ops.request_type(name)) for name in ops.names()]


# A value of another type than each field's, by the field's type.
WRONG = {"int": "1", "str": 1, "bool": 1, "float": "1.0", "list": {"0": 0}, "dict": [0]}


def wrong_value(hint: Any) -> Any:
    text = str(hint)
    for kind, value in WRONG.items():
        if text.startswith((kind, f"<class '{kind}'")):
            return value
    return object  # not JSON at all: the node never sees it; skipped below


# Values of the wrong type or out of range for any field an op might read, and values that
# get a request past an op's first checks (a name it holds or not, its instance, its source).
JUNK: list[Any] = [None, True, -1, 2**70, 1.5, "", "../..", "\udcff", [], [None], {}, {"0": -1}]
FIELDS = [
    "name", "uuid", "source", "segment", "segments", "segment_size", "seg_len", "offset",
    "length", "total", "data", "size", "sizes", "lease", "holder", "lifetime", "replicas",
    "digest", "meta", "bytes", "push", "endpoint", "add", "files", "ranges", "path", "decoded",
    "metas", "key", "manifest_estimate", "meta_bytes", "qp", "gid", "instance", "members",
]  # fmt: skip
REQUESTS_PER_OP = 300


def plausible(world: World, rng: random.Random) -> dict[str, list[Any]]:
    return {
        "name": [DATASET, f"fresh-{rng.randrange(10**9)}"],  # held, and held by no one
        "uuid": [world.uuid],
        "source": [str(world.src)],
        "segment": [0, 1],
        "segments": [[0]],
        "seg_len": [{"0": 10}],
        "offset": [0],
        "length": [1],
        "total": [1],
        "data": ["aGk="],
        "size": [64],
        "push": [True],
    }


def malformed_requests(world: World, op: str) -> Iterator[dict[str, Any]]:
    """Requests with fields missing, of the wrong type or out of range: a few fields each, of
    junk or of plausible values (seeded by the op: a failure is reproducible)."""
    rng = random.Random(op)
    yield {}
    for _ in range(REQUESTS_PER_OP):
        good = plausible(world, rng)
        request = {f: rng.choice(values) for f, values in good.items() if rng.random() < 0.7}
        for f in rng.sample(FIELDS, rng.randint(1, 3)):
            request[f] = rng.choice(JUNK)
        yield request


@pytest.mark.parametrize("op", [op for op in registered_ops() if op != "shutdown"])
def test_a_malformed_request_to_any_op_gets_a_one_line_answer(world: World, op: str) -> None:
    node = world.node
    tracebacks = node.log().count("Traceback")
    internal = 0
    with node.client() as c:
        connections = c.request("status")["stats"]["connections"]
        for args in malformed_requests(world, op):
            try:
                c.request(op, **args)
            except InternalError as e:  # a handler's bug: still an answer, in one line
                assert str(e).startswith(f"internal error in op {op}: "), str(e)
                internal += 1
            except KSpeedError as e:
                assert str(e) and "\n" not in str(e), (op, args)
        # Every request was answered on this one connection: none was closed.
        assert c.request("status")["stats"]["connections"] == connections
    # Each unexpected exception was logged once with its traceback, nothing else was.
    assert node.log().count("Traceback") - tracebacks == internal
    if DATASET not in [d["name"] for d in node.request("list")["datasets"]]:
        done = run_cli("preload", str(world.src), "--name", DATASET, "-q", env=node.env())
        assert done.returncode == 0, done.stderr
        world.uuid = node.request("progress", name=DATASET)["uuid"]


@pytest.mark.parametrize(("op", "request_type"), typed_ops())
def test_a_typed_op_refuses_each_wrong_or_missing_field_in_one_line_naming_it(
    world: World, op: str, request_type: type[Request]
) -> None:
    """From the op's request type: each required field left out, each field of another
    type, and an unknown field are InvalidArgument (exit 5) in one line naming the op, and
    the node goes on serving on the same connection."""
    bad: list[dict[str, Any]] = [{"surprise": 1}]
    bad += [{"__omit__": name} for name in contract.required(request_type)]
    for name, hint in contract.field_types(request_type).items():
        value = wrong_value(hint)
        if value is not object:
            bad.append({name: value})
    with world.node.client() as c:
        for change in bad:
            args = {k: v for k, v in change.items() if k != "__omit__"}
            with pytest.raises(InvalidArgument) as refused:
                c.request(op, **args)
            message = str(refused.value)
            assert message.startswith(f"op {op}: ") and "\n" not in message, (change, message)
        assert c.request("ping")["node"] == world.node.address


def test_the_dispatcher_answers_an_unexpected_exception_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler's bug is an InternalError of one line, logged once with its traceback; a
    nursery's group of refusals keeps the refusal's class (and so its exit code)."""

    @dataclasses.dataclass(frozen=True)
    class Buggy(Request):
        OP = "buggy"

    @dataclasses.dataclass(frozen=True)
    class Refusals(Request):
        OP = "refusals"

    async def buggy(request: Buggy) -> dict[str, Any]:
        raise RuntimeError("a bug\nover two lines")

    async def refusals(request: Refusals) -> dict[str, Any]:
        raise ExceptionGroup("members", [NoSpace("no room on a"), NoSpace("no room on b")])

    ops = OpRegistry()
    ops.add(Buggy, buggy, READ)
    ops.add(Refusals, refusals, READ)
    with pytest.raises(InternalError) as failed:
        trio.run(ops.dispatch, {"op": "buggy"}, READ)
    assert str(failed.value) == "internal error in op buggy: RuntimeError: a bug over two lines"
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "op buggy" in logged[0].getMessage()
    with pytest.raises(NoSpace, match="no room on a"):
        trio.run(ops.call, Refusals())
