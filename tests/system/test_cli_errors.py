"""Each bad CLI input: a one-line error, its documented exit code, and nothing changed."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, free_port, make_tree, node_in, run_cli

from kspeedfs.format.errors import EXIT_CODES_DOC, InvalidArgument


@dataclasses.dataclass
class World:
    tmp: Path
    src: Path
    shm: Path
    node: NodeProcess


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One node with one dataset ("ok") that fills most of a small memory budget."""
    tmp = tmp_path_factory.mktemp("cli")
    with node_in(tmp, memory="4MiB") as node:
        src = make_tree(tmp / "src")
        done = run_cli("preload", str(src), "--name", "ok", "-q", env=node.env())
        assert done.returncode == 0, done.stderr
        (tmp / "a-file").write_text("not a folder")
        (tmp / "mnt").mkdir()
        yield World(tmp, src, node.shm_dir, node)


def documented_codes() -> dict[int, str]:
    codes = {}
    for line in EXIT_CODES_DOC.splitlines()[1:]:
        code, text = line.split(maxsplit=1)
        codes[int(code)] = text
    return codes


def snapshot(node: NodeProcess, shm: Path) -> tuple[str, list[str], list[str]]:
    """What must not change: the node's dataset list, its shm folder, the mounts made here."""
    done = run_cli("ls", "--json", env=node.env())
    assert done.returncode == 0, done.stderr
    files = sorted(str(p.relative_to(shm)) for p in shm.rglob("*"))
    with open("/proc/self/mounts") as f:
        # Only mounts under this node's folders: other tests on the machine mount too.
        mounts = sorted(line for line in f if str(node.log_path.parent) in line)
    return done.stdout, files, mounts


def check_error(done: object, code: int, fragment: str) -> None:
    import subprocess

    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode == code, (done.returncode, done.stderr)
    assert code in documented_codes()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"not one line: {done.stderr!r}"
    assert lines[0].startswith("kspeedfs: "), lines
    assert "Traceback" not in done.stderr
    assert re.search(fragment, lines[0]), lines[0]
    assert done.stdout == ""


CASES = [
    # (id, argv with {tmp}/{src} placeholders, exit code, message pattern)
    ("source missing", ["preload", "{tmp}/missing", "--name", "x"], 4, "source not found"),
    ("source not a folder", ["preload", "{tmp}/a-file", "--name", "x"], 5, "not a folder"),
    ("bad name", ["preload", "{src}", "--name", "Bad Name"], 5, "bad dataset name"),
    ("bad name with slash", ["preload", "{src}", "--name", "../x"], 5, "bad dataset name"),
    ("name already loaded", ["preload", "{src}", "--name", "ok"], 6, "already loaded"),
    ("mountpoint missing", ["mount", "{tmp}/no-mnt"], 8, "does not exist"),
    ("mountpoint a file", ["mount", "{tmp}/a-file"], 8, "not a folder"),
    ("unknown --dataset", ["mount", "{tmp}/mnt", "--dataset", "nope"], 4, "no dataset named"),
    ("bad --dataset name", ["mount", "{tmp}/mnt", "--dataset", "NOPE"], 5, "bad dataset name"),
    ("unload unknown", ["unload", "nope"], 4, "no dataset named"),
    ("unload bad name", ["unload", "No"], 5, "bad dataset name"),
    ("bad mount option", ["mount", "{tmp}/mnt", "-o", "rw"], 8, "unsupported mount option"),
    ("umount not mounted", ["umount", "{tmp}/mnt"], 8, "not a kspeedfs mount"),
]


@pytest.mark.parametrize(
    ("argv", "code", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input(world: World, argv: list[str], code: int, fragment: str) -> None:
    node = world.node
    args = [a.format(tmp=world.tmp, src=world.src) for a in argv]
    before = snapshot(node, world.shm)
    done = run_cli(*args, env=node.env())
    check_error(done, code, fragment)
    assert snapshot(node, world.shm) == before
    assert not os.path.ismount(world.tmp / "mnt")


@pytest.mark.slow  # fills a node to its budget
def test_over_memory_budget(shm_dir: Path, token_file: Path, tmp_path: Path, tree: Path) -> None:
    node = NodeProcess(shm_dir, token_file, tmp_path, memory="4MiB").start()
    try:
        done = run_cli("preload", str(tree), "--name", "first", "-q", env=node.env())
        assert done.returncode == 0, done.stderr
        before = snapshot(node, shm_dir)
        for wait in ([], ["--no-wait"]):
            done = run_cli("preload", str(tree), "--name", "second", "-q", *wait, env=node.env())
            check_error(done, 7, "needs .* budget")
            assert snapshot(node, shm_dir) == before
    finally:
        node.stop()


@pytest.mark.parametrize(
    "argv",
    [
        ["ls"],
        ["status"],
        ["preload", "{src}", "--name", "x"],
        ["unload", "ok"],
        ["mount", "{tmp}/mnt"],
    ],
    ids=lambda a: a[0],
)
def test_node_not_running(world: World, argv: list[str]) -> None:
    node = world.node
    before = snapshot(node, world.shm)
    env = {**node.env(), "KSPEEDFS_NODES": f"127.0.0.1:{free_port()}"}
    args = [a.format(tmp=world.tmp, src=world.src) for a in argv]
    check_error(run_cli(*args, env=env), 3, "no kspeedfs node at 127.0.0.1")
    assert snapshot(node, world.shm) == before
    assert not os.path.ismount(world.tmp / "mnt")


@pytest.mark.fuse
def test_mountpoint_busy(world: World) -> None:
    node = world.node
    tmp: Path = world.tmp
    m = MountProcess(tmp / "busy", node.env(), tmp)
    try:
        m.start()
        before = snapshot(node, world.shm)
        for extra in ([], ["--foreground"]):
            done = run_cli("mount", str(m.mountpoint), *extra, env=node.env())
            check_error(done, 8, "busy")
        assert snapshot(node, world.shm) == before
        assert (m.mountpoint / "ok" / "a" / "small.txt").read_bytes() == b"hello kspeedfs\n"
    finally:
        m.stop()


def test_node_checks_names_and_sources_itself(world: World) -> None:
    """A client that skips the CLI's checks still cannot get bad input past the node."""
    node = world.node
    before = snapshot(node, world.shm)
    for name in ("../etc", "UPPER", "", "x" * 65, "a\n"):
        with pytest.raises(InvalidArgument):
            node.request("preload", name=name, source=str(world.src))
    with pytest.raises(InvalidArgument):
        node.request("preload", name="rel", source="relative/path")
    with pytest.raises(InvalidArgument):
        node.request("preload", name="life", source=str(world.src), lifetime="forever")
    with pytest.raises(InvalidArgument):
        node.request("no-such-op")
    assert snapshot(node, world.shm) == before


def test_bad_command_line_is_exit_2(world: World) -> None:
    node = world.node
    done = run_cli("preload", env=node.env())  # the source missing
    assert done.returncode == 2
    assert "source" in done.stderr
    done = run_cli("node", "--memory", "lots", env=node.env())
    check_error(done, 5, "not a size")
