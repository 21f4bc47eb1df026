"""The disk tier's folders are the node's, as the shm folder is: a planted spill or tier folder
is refused with nothing changed; readers in the group map disk-tier segments directly, and a
uid outside it cannot open them (it reads through passed descriptors with a token)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import KSPEEDFS, NodeProcess, free_port, wait_for
from uidutil import NOBODY, as_user

import kspeedfs.client.reader  # noqa: F401  (loaded before the fork: uid 65534 cannot read the venv)
from kspeedfs.format import auth
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.sealing import sealed_beneath, unseal_tree

pytestmark = pytest.mark.slow  # a node start per case, readers forked as uid 65534

GROUP = 4242  # the readers' group of these tests (a gid: no name needed)
SECRET = os.urandom(3 << 19)  # 1.5 MiB: two 1 MiB segments
TIER = "tier"

CHILD = r"""
import json, os, sys
from pathlib import Path
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import KSpeedError
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.format.units import Address

port, shm, token, seg_dir = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
out = {"uid": os.getuid(), "segments": {}}
for name in ("00000000", "00000001"):
    try:
        out["segments"][name] = len(open(seg_dir / name, "rb").read())
    except OSError as e:
        out["segments"][name] = e.__class__.__name__
try:
    local = LocalDataset(shm / "datasets" / "priv")
    out["held"] = sorted(local.held)
    out["direct"] = local.read(local.manifest.resolve("secret.bin"), 0, 1 << 21).hex()
except KSpeedError as e:
    out["direct"] = type(e).__name__
addr = Address("127.0.0.1", port)
settings = Settings(listen=addr, nodes=[addr], token_file=Path(token), shm_dir=shm, timeout=10)
reader = ClusterReader(settings, str(addr))
try:
    ds = reader.open_dataset("priv")
    out["local"] = type(ds.local).__name__
    out["read"] = reader.read(ds, ds.manifest.resolve("secret.bin"), 0, 1 << 21).hex()
    out["stats"] = {k: v for k, v in reader.stats.items() if v and not k.endswith("_bytes")}
except KSpeedError as e:
    out["read"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "important").mkdir(parents=True)
    (victim / "important" / "data.txt").write_text("keep me\n")
    return victim


def _state(*roots: Path) -> dict[str, tuple[int, int, int]]:
    """Mode, owner and group of everything under `roots` (symlinks not followed)."""
    out = {}
    for root in roots:
        paths = [root]
        if root.is_dir() and not root.is_symlink():
            for dirpath, dirnames, filenames in os.walk(root):
                paths += [Path(dirpath, n) for n in dirnames + filenames]
        for p in paths:
            st = os.lstat(p)
            out[str(p)] = (st.st_mode, st.st_uid, st.st_gid)
    return out


def _plant(how: str, spill: Path, victim: Path) -> None:
    """A spill folder (with a tier folder) that somebody else could have changed."""
    if how == "spill-symlink":
        os.symlink(victim, spill)
        return
    spill.mkdir(mode=0o700)
    if how == "spill-world-writable":
        os.chmod(spill, 0o777)
        (spill / TIER).mkdir(mode=0o700)
        return
    if how == "tier-symlink":
        os.symlink(victim, spill / TIER)
        return
    # A tier folder with a leftover in its staging folder, which a node that went on removes.
    (spill / TIER / ".staging" / "leftover.1234").mkdir(parents=True)
    if how == "tier-other-owner":
        os.chown(spill / TIER, NOBODY, NOBODY)
    else:
        os.chmod(spill / TIER, 0o777)


@pytest.mark.parametrize(
    "how",
    [
        "tier-symlink",
        "tier-other-owner",
        "tier-world-writable",
        "spill-symlink",
        "spill-world-writable",
    ],
)
def test_planted_disk_tier_folder_is_refused(
    how: str, shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    spill = tmp_path / "spill"
    _plant(how, spill, victim)
    before = _state(spill, victim)
    env = {**os.environ, "KSPEEDFS_TOKEN_FILE": str(token_file)}
    cmd = [*KSPEEDFS, "node", "--listen", f"127.0.0.1:{free_port()}", "--shm-dir", str(shm_dir)]
    cmd += ["--spill-dir", str(spill), "--spill", "64MiB"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == InvalidArgument.exit_code, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("kspeedfs:")]
    what = "spill folder" if how.startswith("spill") else "disk tier folder"
    assert len(errors) == 1 and f"refusing {what} " in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert _state(spill, victim) == before  # nothing changed, on either side of a symlink
    assert (victim / "important" / "data.txt").read_text() == "keep me\n"


def _node(shm_dir: Path, token_file: Path, tmp_path: Path, spill: Path) -> NodeProcess:
    env = {**os.environ, "KSPEEDFS_GROUP": str(GROUP), "KSPEEDFS_ACCESS": "source"}
    extra = ("--spill-dir", str(spill), "--spill", "64MiB")
    return NodeProcess(shm_dir, token_file, tmp_path, extra=extra, base_env=env).start()


def _preload_on_disk(node: NodeProcess, public_dir: Path) -> Path:
    """`priv` (one 0644 file in a 0755 folder) on the disk tier only; its segment folder."""
    src = public_dir / "src"
    src.mkdir()
    (src / "secret.bin").write_bytes(SECRET)
    os.chmod(src / "secret.bin", 0o644)
    # A memory cap of 1 byte keeps every segment on the disk tier: none is promoted.
    node.request("preload", name="priv", source=str(src), tier="disk", max_memory=1)
    wait_for(lambda: node.request("progress", name="priv")["state"] == "ready")
    record = next(d for d in node.request("list")["datasets"] if d["name"] == "priv")
    assert sorted(record["disk"]) == sorted(record["held"]) == [0, 1], record
    return public_dir / "spill" / TIER / f"priv.{record['uuid']}" / "seg"


def _as_nobody(node: NodeProcess, token: Path, seg_dir: Path, groups: list[int]) -> dict[str, Any]:
    """Run CHILD as uid 65534 in `groups`; what it printed, as JSON."""

    def child() -> Any:
        sys.argv = ["child", str(node.port), str(node.shm_dir), str(token), str(seg_dir)]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(CHILD, "child", "exec"), {"__name__": "child"})
        return json.loads(printed.getvalue())

    out: dict[str, Any] = as_user(NOBODY, groups, child)
    assert out["uid"] == NOBODY
    return out


def _read_token(public_dir: Path, admin_file: Path) -> Path:
    path = public_dir / "read.token"
    auth.write_token(path, auth.derive_token(auth.read_token(admin_file), "read"))
    os.chown(path, NOBODY, NOBODY)
    return path


def test_in_the_group_disk_segments_are_mapped_directly(
    shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    spill = public_dir / "spill"
    node = _node(shm_dir, token_file, tmp_path, spill)
    try:
        seg_dir = _preload_on_disk(node, public_dir)
        out = _as_nobody(node, _read_token(public_dir, token_file), seg_dir, [GROUP])
        attached = node.request("status")["local_socket"]["attached"]
    finally:
        node.stop()
    assert out["segments"] == {"00000000": 1 << 20, "00000001": 1 << 19}
    assert out["held"] == [0, 1] and out["direct"] == SECRET.hex()
    # The fast path mapped the disk tier's files itself: no descriptors passed, no TCP read.
    assert out["local"] == "LocalDataset" and out["read"] == SECRET.hex()
    assert out["stats"] == {"local": 1} and attached == 0
    _assert_the_groups(spill)


def _assert_the_groups(spill: Path) -> None:
    """Everything in the spill folder is the node's and the group's: folders 2750, files 0640."""
    for path in [spill, *spill.rglob("*")]:
        st = os.lstat(path)
        mode = 0o2750 if stat.S_ISDIR(st.st_mode) else 0o640
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, 0, GROUP), path


def test_a_restart_gives_an_older_tier_the_group_and_modes(
    shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    spill = public_dir / "spill"
    node = _node(shm_dir, token_file, tmp_path, spill)
    try:
        seg_dir = _preload_on_disk(node, public_dir)
    finally:
        node.stop()
    unseal_tree(None, str(seg_dir))  # (a node before sealing left them unsealed too)
    for path in [seg_dir.parent, seg_dir, *seg_dir.iterdir()]:  # as a node before them left it
        os.chown(path, 0, 0)
        os.chmod(path, 0o750 if path.is_dir() else 0o600)
    node = _node(shm_dir, token_file, tmp_path, spill)
    try:
        out = _as_nobody(node, _read_token(public_dir, token_file), seg_dir, [GROUP])
    finally:
        node.stop()
    assert out["held"] == [0, 1] and out["direct"] == SECRET.hex()
    _assert_the_groups(spill)
    if os.geteuid() == 0:  # the restarted node (root) sealed what it found unsealed
        assert len(sealed_beneath(seg_dir)) == 2


def test_outside_the_group_disk_segments_cannot_be_opened(
    shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    node = _node(shm_dir, token_file, tmp_path, public_dir / "spill")
    try:
        seg_dir = _preload_on_disk(node, public_dir)
        out = _as_nobody(node, _read_token(public_dir, token_file), seg_dir, [])
        attached = node.request("status")["local_socket"]["attached"]
    finally:
        node.stop()
    assert set(out["segments"].values()) == {"PermissionError"}
    assert out["direct"] == "DataError" and "held" not in out
    # Its token still gets the segments' descriptors over the fd socket (access = "source").
    assert out["local"] == "PassedDataset" and out["read"] == SECRET.hex()
    assert out["stats"] == {"local": 1} and attached == 1
