"""What new users ran into: messages that name the role a refusal is about, paths inside a
mount given to the fast path and `preload`, folder sizes on the mount, the node's shm folder
after it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, kw, make_tree, preload, run_cli

from kspeedfs.format import auth
from kspeedfs.format.errors import AuthError, InvalidArgument
from pytorch_ext import KSpeedFolder


@pytest.mark.slow  # a CLI process
def test_a_read_roles_active_preload_names_the_role_it_needs_and_has(
    node: NodeProcess, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "src")
    read_token = tmp_path / "read.token"
    auth.write_token(read_token, auth.derive_read_token(auth.read_token(node.token_file)))
    with pytest.raises(AuthError) as refused:
        KSpeedFolder(str(src), nodes=node.address, token=str(read_token))
    message = str(refused.value)
    assert "preload needs the job role; this client has read" in message, message
    assert "admin token" not in message
    assert node.request("list")["datasets"] == []
    env = {**node.env(), "KSPEEDFS_TOKEN_FILE": str(read_token)}
    done = run_cli("preload", str(src), "--name", "x", env=env)
    assert done.returncode == 9, done.stderr
    assert "preload needs the job role; this client has read" in done.stderr
    KSpeedFolder(str(src), **kw(node))  # the admin token may


def test_a_clean_stop_leaves_no_socket_folder(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    run = shm_dir.with_name(shm_dir.name + ".run")  # the socket's folder by default
    node = NodeProcess(shm_dir, token_file, tmp_path).start()
    try:
        assert (run / "fd.sock").is_socket()
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)  # not node.stop(): it tidies up after a kill
        assert node.proc.wait(timeout=30) == 0, node.log()
        assert not run.exists()
        assert shm_dir.is_dir()  # what the node holds stays for its next start
    finally:
        node.stop()


@pytest.mark.slow  # a mount
@pytest.mark.fuse
def test_folders_on_the_mount_have_the_sources_sizes(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = make_tree(tmp_path / "src")
    crowded = src / "crowded"
    crowded.mkdir()
    for i in range(300):  # past one block: ext4 grows the folder
        (crowded / f"a-rather-long-file-name-{i:04d}.txt").write_bytes(b"%d\n" % i)
    preload(node, src, "sized")
    m = MountProcess(tmp_path / "mnt", node.env(), tmp_path, args=("--dataset", "sized"))
    mounts.append(m)
    m.start()
    folders = [p for p in src.rglob("*") if p.is_dir() and not p.is_symlink()]
    assert os.stat(crowded).st_size > 4096
    for folder in [src, *folders]:
        rel = folder.relative_to(src)
        assert os.stat(m.mountpoint / rel).st_size == os.stat(folder).st_size, rel
    # du -sb adds up the apparent sizes of files, folders and links (a hard link once).
    du = [run(["du", "-sb", str(path)]).split()[0] for path in (src, m.mountpoint)]
    assert du[0] == du[1]


def run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


@pytest.mark.slow  # two mounts
@pytest.mark.fuse
def test_a_path_on_a_mount_is_the_dataset_behind_it(
    node: NodeProcess, tmp_path: Path, mounts: list[MountProcess]
) -> None:
    src = make_tree(tmp_path / "src")
    preload(node, src, "base")
    every = MountProcess(tmp_path / "every", node.env(), tmp_path)
    one = MountProcess(tmp_path / "one", node.env(), tmp_path, args=("--dataset", "base"))
    mounts += [every, one]
    every.start()
    one.start()
    want = KSpeedFolder(str(src), **kw(node))
    reads_before = fuse_reads(every.mountpoint)
    for root, rel in (
        (every.mountpoint / "base", ""),
        (one.mountpoint, ""),
        (one.mountpoint / "a", "a"),
    ):
        ds = KSpeedFolder(str(root), **kw(node))
        assert ds.dataset_name == "base"
        assert list(ds.files) == [f for f in KSpeedFolder(str(src / rel), **kw(node)).files]
        for f in ds.files:
            assert bytes(ds.read(f)) == (src / rel / f).read_bytes()
    assert fuse_reads(every.mountpoint) == reads_before  # nothing read back through FUSE
    assert [d["name"] for d in node.request("list")["datasets"]] == ["base"]
    assert len(want) > 3

    with pytest.raises(InvalidArgument, match="the root of a kspeedfs mount"):
        KSpeedFolder(str(every.mountpoint), **kw(node))
    with pytest.raises(InvalidArgument, match="not of dataset other"):
        KSpeedFolder(str(one.mountpoint), objname="other", **kw(node))
    # Never listed: a copy made with cp -a does not carry it.
    assert "user.kspeedfs.dataset" not in os.listxattr(one.mountpoint / "a" / "small.txt")
    (every.mountpoint / "base" / "a" / "small.txt").read_bytes()
    assert fuse_reads(every.mountpoint) > reads_before  # the count counts

    env = node.env()
    done = run_cli("preload", str(every.mountpoint / "base"), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("base: ready, cached already"), done.stdout
    done = run_cli("preload", str(one.mountpoint / "a"), "--name", "sub", env=node.env())
    assert done.returncode == 5, done.stderr
    assert f"preload its source: {src / 'a'}" in done.stderr and "\n" not in done.stderr.strip()
    assert [d["name"] for d in node.request("list")["datasets"]] == ["base"]
    # mount --source of a dataset on a mount mounts that dataset; of a folder in it, refused.
    done = run_cli("mount", str(tmp_path / "no"), "--source", str(one.mountpoint / "a"), env=env)
    assert done.returncode == 5 and "mount --dataset base" in done.stderr, done.stderr
    again = MountProcess(tmp_path / "again", env, tmp_path, args=("--source", str(one.mountpoint)))
    mounts.append(again)
    again.start()
    assert sorted(os.listdir(again.mountpoint)) == sorted(os.listdir(src))
    assert [d["name"] for d in node.request("list")["datasets"]] == ["base"]


def fuse_reads(mountpoint: Path) -> int:
    """READ requests the mount has answered (its serving processes together)."""
    stats = json.loads(os.getxattr(mountpoint, "user.kspeedfs.stats"))
    return int(stats.get("read", 0))
