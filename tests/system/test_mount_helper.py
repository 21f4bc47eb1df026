"""mount.kspeedfs, invoked the way mount(8) runs helpers: mounts and returns, or fails cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import KSPEEDFS, NodeProcess, run_cli, wait_for
from mountdutil import kspeedfs_mounts_under, unmount_all_under

from kspeedfs.format.errors import InvalidArgument
from kspeedfs.fuse.mount_helper import split_options, translate_options
from kspeedfs.system.mountinfo import is_stale, kspeedfs_mounted, mount_entries

pytestmark = pytest.mark.slow  # mount.kspeedfs waits and retries

HELPER = str(Path(sys.executable).parent / "mount.kspeedfs")


@pytest.fixture
def loaded(node: NodeProcess, tree: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    done = run_cli("preload", str(tree), "--name", "ds", "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    yield node
    unmount_all_under(tmp_path)


def helper(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # capture_output also proves the background process let go of the caller's stdout/stderr:
    # run() waits for both pipes to close.
    return subprocess.run(
        [HELPER, *args], capture_output=True, text=True, timeout=120, env=env or plain_env()
    )


def plain_env() -> dict[str, str]:
    """mount(8)'s environment: no KSPEEDFS_* settings, so the -o options must carry them."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}


@pytest.mark.fuse
@pytest.mark.parametrize("source", ["ds", "all"])
def test_helper_mounts_like_mount8_and_returns(
    loaded: NodeProcess, tree: Path, tmp_path: Path, source: str
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    opts = (
        f"rw,_netdev,nofail,defaults,noauto,x-systemd.automount,comment=x,allow_other,"
        f"nodes={loaded.address},token_file={loaded.token_file}"
    )
    done = helper(source, str(mp), "-o", opts, "-n", "-t", "fuse.kspeedfs")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    entry = next(e for e in mount_entries() if e.mountpoint == str(mp))
    assert entry.fstype == "fuse.kspeedfs"
    root = mp if source == "ds" else mp / "ds"
    assert (root / "a" / "small.txt").read_bytes() == (tree / "a" / "small.txt").read_bytes()
    with pytest.raises(OSError):
        (root / "new.txt").write_bytes(b"read-only")
    mountinfo = Path("/proc/self/mountinfo").read_text()
    line = next(line for line in mountinfo.splitlines() if f" {mp} " in line)
    assert "allow_other" in line


@pytest.mark.fuse
def test_helper_mounts_over_a_stale_leftover(
    loaded: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    crashed = subprocess.Popen(
        [*KSPEEDFS, "mount", str(mp), "--foreground"],
        env=loaded.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: kspeedfs_mounted(mp), what="the mount that will crash")
    finally:
        crashed.kill()
        crashed.wait()
    assert is_stale(mp)
    opts = f"nodes={loaded.address},token_file={loaded.token_file}"
    done = helper("ds", str(mp), "-o", opts)
    assert done.returncode == 0, done.stderr
    assert (mp / "a" / "small.txt").read_bytes() == (tree / "a" / "small.txt").read_bytes()
    assert kspeedfs_mounts_under(tmp_path) == [str(mp)]


@pytest.mark.fuse
def test_helper_bad_option_is_a_clear_error_and_mounts_nothing(
    loaded: NodeProcess, tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    done = helper("ds", str(mp), "-o", f"allow_other,bogus,token_file={loaded.token_file}")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unsupported mount option 'bogus'" in lines[0], done.stderr
    assert kspeedfs_mounts_under(tmp_path) == []


@pytest.mark.fuse
def test_helper_unknown_dataset_is_a_clear_error_and_mounts_nothing(
    loaded: NodeProcess, tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    opts = f"nodes={loaded.address},token_file={loaded.token_file}"
    done = helper("nope", str(mp), "-o", opts)
    assert done.returncode == 32
    assert done.stderr.strip().splitlines() == [
        "mount.kspeedfs: no dataset named 'nope' on the node"
    ]
    assert kspeedfs_mounts_under(tmp_path) == []
    assert not os.path.ismount(mp)


@pytest.mark.fuse
def test_helper_without_a_node_fails_before_mounting(tmp_path: Path, token_file: Path) -> None:
    from conftest import free_port

    mp = tmp_path / "mnt"
    mp.mkdir()
    opts = f"nodes=127.0.0.1:{free_port()},token_file={token_file},timeout=2"
    done = helper("all", str(mp), "-o", opts)
    assert done.returncode == 32
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no kspeedfs node" in done.stderr or "did not answer" in done.stderr
    assert kspeedfs_mounts_under(tmp_path) == []


@pytest.mark.fuse
def test_helper_waits_for_a_node_that_is_still_starting(
    shm_dir: Path, token_file: Path, tree: Path, tmp_path: Path
) -> None:
    """At boot mount(8) may run before the node listens: the helper waits within its timeout."""
    node = NodeProcess(shm_dir, token_file, tmp_path).start()
    try:
        done = run_cli("preload", str(tree), "--name", "ds", "-q", env=node.env())
        assert done.returncode == 0, done.stderr
    finally:
        node.stop()
    mp = tmp_path / "mnt"
    mp.mkdir()
    opts = f"nodes={node.address},token_file={token_file},timeout=60"
    proc = subprocess.Popen(
        [HELPER, "ds", str(mp), "-o", opts, "-v"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=plain_env(),
    )
    try:
        assert proc.stderr is not None
        # The node comes back (same port and shm folder) only once the helper found none.
        for line in proc.stderr:
            if "waiting for a node" in line:
                break
        node.start()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert (mp / "a" / "small.txt").read_bytes() == (tree / "a" / "small.txt").read_bytes()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        unmount_all_under(tmp_path)
        node.stop()


def test_helper_fake_and_usage_errors(tmp_path: Path) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    assert helper("ds", str(mp), "-f", "-o", "allow_other,_netdev").returncode == 0
    assert not os.path.ismount(mp)
    wrong_type = helper("ds", str(mp), "-t", "nfs")
    assert wrong_type.returncode == 1 and "not a kspeedfs type" in wrong_type.stderr
    bad_name = helper("Bad/Name", str(mp))
    assert bad_name.returncode == 1 and "bad dataset name" in bad_name.stderr
    missing = helper("ds")
    assert missing.returncode == 1
    assert helper("ds", str(tmp_path / "absent"), "-f").returncode == 32


def test_options_are_translated() -> None:
    opts = split_options('defaults,nodes="h1:1,h2:2",allow_other,x-systemd.requires=a.service')
    assert opts == ["defaults", "nodes=h1:1,h2:2", "allow_other", "x-systemd.requires=a.service"]
    fuse, values = translate_options(opts + ["token-file=/t", "nofail", "users", "comment=x"])
    assert fuse == ["allow_other"]
    assert values == {"nodes": "h1:1,h2:2", "token_file": "/t"}
    assert translate_options(["nodes=h1:1;h2:2"])[1] == {"nodes": "h1:1,h2:2"}
    assert translate_options(["bogus", "allow_root"], sloppy=True) == (["allow_root"], {})
    with pytest.raises(InvalidArgument, match="needs a value"):
        translate_options(["nodes="])
    with pytest.raises(InvalidArgument, match="unsupported mount option 'uid=0'"):
        translate_options(["uid=0"])
    with pytest.raises(InvalidArgument, match="unbalanced quote"):
        split_options('nodes="a,b')
