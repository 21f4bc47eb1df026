"""Local readers as a real unprivileged uid: no token and no group, nothing; a token, passed fds;
the group, direct maps."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, wait_for
from uidutil import NOBODY, as_user

from kspeedfs.format import auth

GROUP = 4242  # the readers' group of these tests (no name needed: a gid works)
SECRET = os.urandom(3000)

CHILD = r"""
import json, os, sys
from pathlib import Path
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import KSpeedError
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.format.units import Address

port, shm, token, name = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
out = {"uid": os.getuid()}
ds_dir = shm / "datasets" / name
for what, path in (("segment", ds_dir / "seg" / "00000000"), ("manifest", ds_dir / "manifest.ksm")):
    try:
        out[what] = len(open(path, "rb").read())
    except OSError as e:
        out[what] = e.__class__.__name__
try:
    local = LocalDataset(ds_dir)
    i = next(k for k in local.manifest.iter_files() if local.manifest.path(k) == b"secret.bin")
    out["direct"] = local.read(i, 0, 1 << 20).hex()
except KSpeedError as e:
    out["direct"] = type(e).__name__
addr = Address("127.0.0.1", port)
settings = Settings(listen=addr, nodes=[addr], token_file=Path(token), shm_dir=shm, timeout=10)
reader = ClusterReader(settings, str(addr))
try:
    ds = reader.open_dataset(name)
    out["local"] = type(ds.local).__name__
    i = next(k for k in ds.manifest.iter_files() if ds.manifest.path(k) == b"secret.bin")
    out["read"] = reader.read(ds, i, 0, 1 << 20).hex()
    out["stats"] = dict(reader.stats)
except KSpeedError as e:
    out["read"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def _node(shm_dir: Path, token_file: Path, tmp_path: Path, access: str) -> NodeProcess:
    env = {**os.environ, "KSPEEDFS_GROUP": str(GROUP), "KSPEEDFS_ACCESS": access}
    return NodeProcess(shm_dir, token_file, tmp_path, base_env=env).start()


def _preload(node: NodeProcess, src: Path) -> None:
    node.request("preload", name="priv", source=str(src))
    wait_for(lambda: node.request("progress", name="priv")["state"] == "ready")


def _source(public_dir: Path, folder_mode: int, file_mode: int = 0o600) -> Path:
    src = public_dir / "src"
    src.mkdir()
    (src / "secret.bin").write_bytes(SECRET)
    os.chmod(src / "secret.bin", file_mode)
    os.chmod(src, folder_mode)
    return src


def _token(public_dir: Path, admin_file: Path, role: str | None) -> Path:
    path = public_dir / f"{role}.token"
    if role is None:
        return path  # none
    auth.write_token(path, auth.derive_token(auth.read_token(admin_file), role))
    os.chown(path, NOBODY, NOBODY)
    return path


def _as_nobody(node: NodeProcess, token: Path, groups: list[int]) -> dict[str, Any]:
    """Run CHILD as uid 65534; what it printed, as JSON."""
    import kspeedfs.client.reader  # noqa: F401  (loaded before the fork)

    def child() -> Any:
        sys.argv = ["child", str(node.port), str(node.shm_dir), str(token), "priv"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(CHILD, "child", "exec"), {"__name__": "child"})
        return json.loads(printed.getvalue())

    out: dict[str, Any] = as_user(NOBODY, groups, child)
    assert out["uid"] == NOBODY
    return out


def test_without_token_or_group_nothing_is_readable(
    shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    node = _node(shm_dir, token_file, tmp_path, "source")
    try:
        _preload(node, _source(public_dir, 0o755))
        out = _as_nobody(node, _token(public_dir, token_file, None), [])
    finally:
        node.stop()
    assert out["segment"] == out["manifest"] == "PermissionError"
    assert out["direct"] == "DataError"
    assert out["read"].startswith("AuthError")
    assert SECRET.hex() not in json.dumps(out)


def test_a_read_token_reads_through_passed_fds(
    shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    node = _node(shm_dir, token_file, tmp_path, "source")
    try:
        # 0644: passed descriptors hold only files the uid could read at the source
        # (test_security_access.py has the 0600 case).
        _preload(node, _source(public_dir, 0o755, 0o644))
        out = _as_nobody(node, _token(public_dir, token_file, "read"), [])
        attached = node.request("status")["local_socket"]["attached"]
    finally:
        node.stop()
    assert out["segment"] == out["manifest"] == "PermissionError"  # still not by path
    assert out["local"] == "PassedDataset"
    assert out["read"] == SECRET.hex()
    # The fast path's local map served it (no TCP read); byte counts aside.
    assert {k: v for k, v in out["stats"].items() if not k.endswith("_bytes")} == {"local": 1}
    assert attached == 1


def test_in_the_group_segments_are_read_directly(
    shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    node = _node(shm_dir, token_file, tmp_path, "source")
    try:
        _preload(node, _source(public_dir, 0o755))
        out = _as_nobody(node, _token(public_dir, token_file, None), [GROUP])
    finally:
        node.stop()
    assert isinstance(out["segment"], int) and isinstance(out["manifest"], int)
    assert out["direct"] == SECRET.hex()


@pytest.mark.parametrize("access", ["source", "open"])
def test_access_source_keeps_the_source_folder_rule_for_passed_fds(
    access: str, shm_dir: Path, token_file: Path, tmp_path: Path, public_dir: Path
) -> None:
    node = _node(shm_dir, token_file, tmp_path, access)
    try:
        _preload(node, _source(public_dir, 0o700))  # root's folder: nobody may not list it
        out = _as_nobody(node, _token(public_dir, token_file, "read"), [])
    finally:
        node.stop()
    if access == "source":
        assert out["local"] == "NoneType"
        assert SECRET.hex() not in json.dumps(out)
    else:
        assert out["local"] == "PassedDataset" and out["read"] == SECRET.hex()
