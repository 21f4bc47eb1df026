"""Bad settings through the real CLI: one line naming the setting and where it came from,
exit 5, no traceback, and nothing changed (no node started, nothing written)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, free_port, make_tree, node_in, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.system.mountinfo import lazy_unmount, mount_at


@dataclasses.dataclass
class World:
    tmp: Path
    node: NodeProcess


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One node holding one dataset, and the odd files the cases name."""
    tmp = tmp_path_factory.mktemp("settings")
    with node_in(tmp, memory="64MiB") as node:
        try:
            src = make_tree(tmp / "src")
            done = run_cli("preload", str(src), "--name", "ok", "-q", env=node.env())
            assert done.returncode == 0, done.stderr
            (tmp / "latin1.toml").write_bytes('shm_dir = "/dev/shm/caf\xe9"\n'.encode("latin-1"))
            os.mkfifo(tmp / "fifo")
            (tmp / "mnt").mkdir()
            yield World(tmp, node)
        finally:
            lazy_unmount(tmp / "mnt")  # should a setting let through have mounted after all


def snapshot(world: World) -> tuple[str, list[str]]:
    """What must not change: the node's dataset list and its shm folder."""
    done = run_cli("ls", "--json", env=world.node.env())
    assert done.returncode == 0, done.stderr
    shm = world.node.shm_dir
    return done.stdout, sorted(str(p.relative_to(shm)) for p in shm.rglob("*"))


def one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line of a refused command with exit `code`."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kspeedfs: "), done.stderr
    assert done.stdout == ""
    return lines[0]


CLIENT_CASES = [
    # (id, argv, extra environment, fragments of the one line); {tmp} is the world's folder
    ("non-UTF-8 config", ["ls", "--config", "{tmp}/latin1.toml"], {}, ["latin1.toml", "UTF-8"]),
    ("config a folder", ["ls", "--config", "{tmp}"], {}, ["(from --config)", "regular file"]),
    ("config a FIFO", ["ls"], {"KSPEEDFS_CONFIG": "{tmp}/fifo"}, ["KSPEEDFS_CONFIG", "regular"]),
    ("KSPEEDFS_TIMEOUT=nan", ["ls"], {"KSPEEDFS_TIMEOUT": "nan"}, ["(KSPEEDFS_TIMEOUT)", "finite"]),
    ("--timeout -1", ["ls", "--timeout", "-1"], {}, ["timeout", "(--timeout)", "above 0"]),
    ("--timeout soon", ["status", "--timeout", "soon"], {}, ["(--timeout)", "not a number"]),
    ("--workers=-1", ["mount", "{tmp}/mnt", "--workers=-1"], {}, ["fuse_workers", "(--workers)"]),
    (
        "--metrics-listen",
        ["mount", "{tmp}/mnt", "--metrics-listen", "h:99999"],
        {},
        ["metrics_listen"],
    ),
    ("a huge size", ["ls"], {"KSPEEDFS_SEGMENT_SIZE": "9" * 400}, ["segment_size", "too large"]),
]


@pytest.mark.parametrize(
    ("argv", "extra", "fragments"), [c[1:] for c in CLIENT_CASES], ids=[c[0] for c in CLIENT_CASES]
)
def test_bad_client_setting(
    world: World, argv: list[str], extra: dict[str, str], fragments: list[str]
) -> None:
    before = snapshot(world)
    env = {**world.node.env(), **{k: v.format(tmp=world.tmp) for k, v in extra.items()}}
    line = one_line(run_cli(*(a.format(tmp=world.tmp) for a in argv), env=env, timeout=30), 5)
    assert all(f in line for f in fragments), line
    assert snapshot(world) == before
    assert mount_at(world.tmp / "mnt") is None  # mountinfo: a stale mount is no ismount()


def nothing_started(tmp: Path, argv: list[str], extra: dict[str, str]) -> str:
    """`kspeedfs node` with a bad setting: its one line; no port, shm folder or token made."""
    port, shm = free_port(), Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    token = tmp / f"token-{uuid.uuid4().hex[:8]}"  # a node makes one when it starts
    env = {**os.environ, "KSPEEDFS_TOKEN_FILE": str(token), **extra}
    command = ["node", "--listen", f"127.0.0.1:{port}", "--shm-dir", str(shm), *argv]
    line = one_line(run_cli(*command, env=env, timeout=30), 5)
    assert not shm.exists() and not token.exists()
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
    return line


NODE_CASES = [
    ("--memory=nan%", ["--memory=nan%"], {}, "memory from the command line (--memory)"),
    ("--memory=inf%", ["--memory=inf%"], {}, "memory from the command line (--memory)"),
    ("--memory=-50%", ["--memory=-50%"], {}, "memory from the command line (--memory)"),
    ("--memory=150%", ["--memory=150%"], {}, "memory from the command line (--memory)"),
    ("log level", [], {"KSPEEDFS_LOG_LEVEL": "chatty"}, "(KSPEEDFS_LOG_LEVEL)"),
    ("metrics port", [], {"KSPEEDFS_METRICS_LISTEN": "127.0.0.1:99999"}, "metrics_listen"),
    ("socket path", [], {"KSPEEDFS_SOCKET": "/tmp/" + "s" * 120}, "socket from the environment"),
    ("etcd port", [], {"KSPEEDFS_ETCD": "127.0.0.1:99999"}, "etcd from the environment"),
    ("lease ttl", [], {"KSPEEDFS_LEASE_TTL": "nan"}, "lease_ttl from the environment"),
]


@pytest.mark.parametrize(
    ("argv", "extra", "fragment"), [c[1:] for c in NODE_CASES], ids=[c[0] for c in NODE_CASES]
)
def test_bad_node_setting_starts_nothing(
    tmp_path: Path, argv: list[str], extra: dict[str, str], fragment: str
) -> None:
    assert fragment in nothing_started(tmp_path, argv, extra)


# Generated values. Through the environment, every numeric setting on `ls` against the node:
# refused in one line naming it, or used (listed, or the node not reached in a tiny timeout).
NUMERIC = [
    "lease_ttl",
    "timeout",
    "source_check_interval",
    "member_ttl",
    "heal_after",
    "memory",
    "segment_size",
    "spill",
    "fuse_workers",
    "fuse_read_ahead",
    "decode_workers",
    "rdma_gid_index",
]
_NUMBER = st.one_of(
    st.floats().map(repr),
    st.integers().map(str),
    st.sampled_from(["nan", "-inf", "Infinity", "1e400", "-0", "1_000", " 7 "]),
)
_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=16
)
VALUES = st.one_of(_NUMBER, _NUMBER.map(lambda s: s + "%"), _NUMBER.map(lambda s: s + "KiB"), _TEXT)


def refused_or_used(done: subprocess.CompletedProcess[str], key: str, where: str) -> None:
    if done.returncode in (0, 3) and "Traceback" not in done.stderr:
        return  # a usable value: listed, or no answer within a tiny timeout (3, one line)
    line = one_line(done, 5)
    assert key in line and f"({where})" in line, line


@pytest.mark.slow  # a command per generated example
def test_generated_values_through_the_environment(world: World) -> None:
    before = snapshot(world)

    @settings(max_examples=30, deadline=None)
    @given(st.sampled_from(NUMERIC), VALUES)
    def check(key: str, value: str) -> None:
        var = f"KSPEEDFS_{key.upper()}"
        done = run_cli("ls", env={**world.node.env(), var: value}, timeout=30)
        refused_or_used(done, key, var)

    check()
    assert snapshot(world) == before


@pytest.mark.slow  # a command per generated example
def test_generated_values_through_flags(world: World) -> None:
    """--timeout on `ls`, --workers on a mount at a missing folder (8 once the value is fine)."""
    before = snapshot(world)

    @settings(max_examples=20, deadline=None)
    @given(st.sampled_from(["--timeout", "--workers"]), VALUES)
    def check(flag: str, value: str) -> None:
        if flag == "--timeout":
            done = run_cli("ls", f"--timeout={value}", env=world.node.env(), timeout=30)
            refused_or_used(done, "timeout", flag)
            return
        missing = str(world.tmp / "no-such-mountpoint")
        done = run_cli("mount", missing, f"--workers={value}", env=world.node.env(), timeout=30)
        if done.returncode == 8:
            assert "does not exist" in one_line(done, 8)
        else:
            assert "fuse_workers from the command line (--workers)" in one_line(done, 5)

    check()
    assert snapshot(world) == before


# A node's sizes through its flags: values that are not sizes by construction (negative,
# not finite, a share over 100%, or holding a character no size has), never a node started.
_NOT_A_SIZE = st.one_of(
    st.floats(max_value=-1e-6).map(repr),
    st.integers(max_value=-1).map(str),
    st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "nan%", "inf%", "-0.5%"]),
    st.floats(min_value=100.001, max_value=1e12).map(lambda x: f"{x}%"),
    st.tuples(_TEXT, st.sampled_from("!#&()*+/:;<=>?@[]^{|}~,"), _TEXT).map("".join),
)


@pytest.mark.slow  # a command per generated example
@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["--memory", "--segment-size", "--spill"]), _NOT_A_SIZE)
def test_generated_bad_sizes_of_a_node_start_nothing(flag: str, value: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        line = nothing_started(Path(tmp), [f"{flag}={value}"], {})
    assert f"from the command line ({flag})" in line, line
