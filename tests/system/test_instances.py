"""A reader gets the bytes of the instance it opened, verified source bytes, or a clear error.

Each test here failed on the code before dataset instances were named end to end: a dataset
unloaded and loaded again under the same name with segments of the same lengths was served to
old readers (FUSE, fast path, remote), partial source reads returned changed or short bytes, the
mount kept every unloaded manifest mapped and died on refresh errors, and a pooled connection
left over from a node restart marked a live node down.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from clusterutil import Cluster, running
from conftest import MountProcess, NodeProcess, run_cli, wait_for
from rt_util import deleted_maps

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import auth
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import DataError, NotFound, StaleDataset
from kspeedfs.format.sealing import unseal_tree
from pytorch_ext import KSpeedFolder

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # reloads under live readers, a second node

OLD = b"B" * 3000


def two_sources(tmp_path: Path) -> tuple[Path, Path]:
    """Two trees whose single segments have the same length (3,000 bytes)."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "b.bin").write_bytes(OLD)
    (new / "b.bin").write_bytes(b"x" * 1000)
    (new / "c.bin").write_bytes(b"y" * 2000)
    return old, new


def preload(env: dict[str, str], source: Path, name: str = "ds", *extra: str) -> None:
    done = run_cli("preload", str(source), "--name", name, "-q", *extra, env=env)
    assert done.returncode == 0, done.stderr


def unload(env: dict[str, str], name: str = "ds") -> None:
    done = run_cli("unload", name, env=env)
    assert done.returncode == 0, done.stderr


def wrong_bytes(got: bytes, expected: bytes) -> int:
    return sum(a != b for a, b in zip(got, expected, strict=False)) + abs(len(got) - len(expected))


def test_an_old_fuse_reader_never_reads_the_reloaded_instance(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    old, new = two_sources(tmp_path)
    preload(node.env(), old)
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(mount.start())
    fd = os.open(mount.mountpoint / "ds" / "b.bin", os.O_RDONLY)  # looked up, nothing read
    try:
        unload(node.env())
        preload(node.env(), new)
        try:
            got = os.pread(fd, 3000, 0)
        except OSError as e:
            assert e.errno in (errno.ESTALE, errno.EIO), e
        else:
            assert wrong_bytes(got, OLD) == 0
    finally:
        os.close(fd)
    # A new walk of the path reaches the new instance.
    wait_for(lambda: (mount.mountpoint / "ds" / "c.bin").exists(), what="the new instance")
    assert (mount.mountpoint / "ds" / "b.bin").read_bytes() == b"x" * 1000


def test_an_old_fast_path_reader_fails_over_to_its_intact_source_then_refuses_a_changed_one(
    node: NodeProcess, tmp_path: Path
) -> None:
    old, new = two_sources(tmp_path)
    preload(node.env(), old)
    ds = KSpeedFolder(str(old), nodes=node.address, token=str(node.token_file))
    assert ds.size("b.bin") == 3000  # attached; no byte read yet
    unload(node.env())
    preload(node.env(), new)
    assert bytes(ds.read("b.bin")) == OLD  # from the old source, which still matches
    (old / "b.bin").write_bytes(b"C" * 3000)  # same size, new contents and time
    with pytest.raises(StaleDataset, match="changed"):
        ds.read("b.bin")


def test_a_remote_node_answers_stale_for_an_instance_it_no_longer_holds(
    token_file: Path, tmp_path: Path
) -> None:
    old, new = two_sources(tmp_path)
    with running(Cluster(token_file, tmp_path, size=2)) as cluster:
        cluster.preload(old, "ds")
        env = cluster.env()
        ds = KSpeedFolder(
            str(old), nodes=",".join(cluster.addresses), token=str(token_file), local=False
        )
        assert bytes(ds.read("b.bin")) == OLD
        unload(env)
        cluster.preload(new, "ds")
        reader = ds._reader
        before = reader.cluster.stats["source"]
        assert bytes(ds.read("b.bin")) == OLD
        assert reader.cluster.stats["source"] == before + 1
        logs = "".join(n.log() for n in cluster.nodes)
        assert "Traceback" not in logs


def test_partial_source_reads_refuse_a_changed_or_shrunk_file(
    node: NodeProcess, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(300_000)
    (src / "big.bin").write_bytes(data)
    preload(node.env(), src)
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    reader = ClusterReader(settings, node.address)
    try:
        handle = reader.open_dataset("ds")
        i = handle.manifest.resolve("big.bin")
        unload(node.env())  # the local copy is gone: reads go to the source
        assert reader.read(handle, i, 1000, 5000) == data[1000:6000]
        (src / "big.bin").write_bytes(os.urandom(300_000))
        with pytest.raises(StaleDataset):
            reader.read(handle, i, 1000, 5000)
        (src / "big.bin").write_bytes(data[:70_000])
        os.utime(src / "big.bin", ns=(0, int(handle.manifest.mtime_ns[i])))
        with pytest.raises(StaleDataset):  # never 4,464 bytes for 65,536
            reader.read(handle, i, 65_536, 65_536)
    finally:
        reader.close()


def test_the_mount_forgets_unloaded_instances(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(mount.start())
    assert mount.proc is not None
    for _cycle in range(3):
        preload(node.env(), tree)
        wait_for(lambda: "ds" in os.listdir(mount.mountpoint), what="the dataset")
        assert (mount.mountpoint / "ds" / "a" / "small.txt").read_bytes() == b"hello kspeedfs\n"
        unload(node.env())
        wait_for(lambda: "ds" not in os.listdir(mount.mountpoint), what="the unload")
    # No manifest, no segment, no damage table: the mount's damage follower lets go of an
    # unloaded instance's table at its next look (fuse/damage_news.py, every 20 ms).
    pid = mount.proc.pid
    wait_for(lambda: deleted_maps(pid, node.shm_dir) == [], what="the unloaded maps let go")


def test_the_mount_survives_a_token_it_no_longer_matches_and_a_node_that_answers_garbage(
    node: NodeProcess, tree: Path, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    preload(node.env(), tree)
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path)
    mounts.append(mount.start())
    small = mount.mountpoint / "ds" / "a" / "small.txt"
    assert small.read_bytes() == b"hello kspeedfs\n"

    # The node comes back with another token: every refresh is refused.
    node.stop()
    real_token = node.token_file
    node.token_file = tmp_path / "rotated"
    auth.write_token(node.token_file, auth.new_admin_token())
    node.start()
    os.listdir(mount.mountpoint)  # a refresh, refused
    wait_for(lambda: "authentication refused" in mount.log(), what="the refused refresh")
    assert mount.proc is not None and mount.proc.poll() is None
    assert (mount.mountpoint / "ds" / "a" / "f001.bin").stat().st_size == 1997

    # Something else listens on the node's port and answers garbage.
    node.stop()
    garbage = socket.create_server(("127.0.0.1", node.port))
    stop = threading.Event()

    def answer_garbage() -> None:
        garbage.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = garbage.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(os.urandom(64) + b"KS\x02\x03" + os.urandom(300))

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: (
                os.listdir(mount.mountpoint) is not None
                and "cannot refresh" in mount.log()
                and mount.log().count("cannot refresh") >= 2
            ),
            what="a refresh against garbage",
        )
        assert mount.proc.poll() is None
        assert small.read_bytes() == b"hello kspeedfs\n"
    finally:
        stop.set()
        thread.join(5)
        garbage.close()

    # The real node with the mount's token again: the list refreshes.
    node.token_file = real_token
    node.start()
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "m.txt").write_bytes(b"more\n")
    preload(node.env(), tmp_path / "more", "more")
    wait_for(lambda: "more" in os.listdir(mount.mountpoint), what="the mount to refresh again")
    assert "Traceback" not in mount.log()


@dataclass
class RemoteRead:
    """A file of the `tree` dataset read by a process that holds none of it."""

    reader: ClusterReader
    handle: DatasetHandle
    entry: int
    expected: bytes

    def read(self) -> bytes:
        return self.reader.read(self.handle, self.entry, 0, len(self.expected))


@pytest.fixture
def remote(node: NodeProcess, tree: Path) -> Iterator[RemoteRead]:
    preload(node.env(), tree)
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)})
    reader = ClusterReader(settings, local_node=None)  # every read over the network
    try:
        handle = reader.open_dataset("ds")
        entry = handle.manifest.resolve("a/f010.bin")
        yield RemoteRead(reader, handle, entry, (tree / "a" / "f010.bin").read_bytes())
    finally:
        reader.close()


def test_a_node_restart_does_not_mark_it_down(
    node: NodeProcess, remote: RemoteRead, caplog: pytest.LogCaptureFixture
) -> None:
    assert remote.read() == remote.expected  # pools a connection
    node.stop()
    node.start()
    assert remote.read() == remote.expected
    assert not remote.reader.pool.is_down(node.address)
    assert remote.reader.stats["source"] == 0
    assert "marked down" not in caplog.text


def test_a_read_frame_for_another_instance_is_refused(node: NodeProcess, tree: Path) -> None:
    preload(node.env(), tree)
    with node.client() as c:
        uuid = next(d["uuid"] for d in c.request("list")["datasets"] if d["name"] == "ds")
        assert len(c.read("ds", uuid, [(0, 0, 10)])) == 10
        with pytest.raises(DataError, match="another instance"):
            c.read("ds", "0" * 32, [(0, 0, 10)])
        assert c.request("ping")["node"] == node.address  # the connection is still good


def test_bytes_from_another_node_are_checked_against_the_manifest(
    node: NodeProcess, remote: RemoteRead, caplog: pytest.LogCaptureFixture
) -> None:
    (seg, off, _n), *_ = remote.handle.manifest.ranges(remote.entry, 0, len(remote.expected))
    # Bit rot in the node's copy: same length, one byte flipped.
    segment = node.shm_dir / "datasets" / "ds" / "seg" / f"{seg:08d}"
    unseal_tree(None, str(segment))  # (a node run as root sealed it: bit rot ignores that)
    with open(segment, "r+b") as f:
        f.seek(off + 7)
        byte = f.read(1)
        f.seek(off + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert remote.read() == remote.expected
    assert remote.reader.stats["source"] == 1
    assert "fail their checksum" in caplog.text


def test_a_lease_keeps_one_instance(node: NodeProcess, tree: Path) -> None:
    preload(node.env(), tree)
    with node.client() as c:
        old = next(d["uuid"] for d in c.request("list")["datasets"] if d["name"] == "ds")
        lease = c.request("lease_acquire", name="ds", uuid=old, holder="job:1")
        assert lease["uuid"] == old and lease["leases"] == 1
    unload(node.env())
    preload(node.env(), tree)
    with node.client() as c:
        assert next(d for d in c.request("list")["datasets"] if d["name"] == "ds")["leases"] == 0
        with pytest.raises(NotFound):  # the unload ended the leases on its instance
            c.request("lease_renew", lease=lease["lease"])
        with pytest.raises(StaleDataset, match="loaded again"):
            c.request("lease_acquire", name="ds", uuid=old, holder="job:1")
