"""`access = "source"`: the mount answers with the source's modes and owners and the kernel checks
them, so an unprivileged uid (65534, in a forked child) reads through a root `allow_other` mount
exactly what it could read at the source; passed descriptors follow the same rule; `access =
"open"` lets everyone read everything. The manifest records the owners (format 2) and still reads
format 1."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MountProcess, NodeProcess, wait_for
from uidutil import NOBODY, as_user

import kspeedfs.client.reader  # loaded before the fork: the venv is not readable by uid 65534
from kspeedfs.format import auth
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.manifest import NS, Manifest, plan_layout, write_arrays, write_manifest
from kspeedfs.format.units import Address
from kspeedfs.sources.scan import scan_tree, tree_from_listing

pytestmark = pytest.mark.slow  # forked readers as other uids, a node per case

GROUP = 4242  # a group uid 65534 is not in (unless a test adds it)
FILES = {  # name: (mode, gid)
    "public.bin": (0o644, 0),
    "private.bin": (0o600, 0),
    "group.bin": (0o640, GROUP),
    "closed/inside.bin": (0o644, 0),  # readable, but in a 0700 folder
}
CONTENT = {name: os.urandom(10_000 + k) for k, name in enumerate(FILES)}


def _source(public_dir: Path) -> Path:
    src = public_dir / "src"
    (src / "closed").mkdir(parents=True)
    for name, (mode, gid) in FILES.items():
        (src / name).write_bytes(CONTENT[name])
        os.chown(src / name, 0, gid)
        os.chmod(src / name, mode)
    os.chmod(src / "closed", 0o700)
    os.chmod(src, 0o755)
    return src


def _read_all(root: Path) -> dict[str, str]:
    """Each file's bytes ("ok" when they equal the source's) or the errno name of the failure."""
    out = {}
    for name in FILES:
        try:
            data = (root / name).read_bytes()
            out[name] = "ok" if data == CONTENT[name] else "wrong bytes"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno or 0, repr(e))
    return out


@contextlib.contextmanager
def _mounted(
    public_dir: Path, shm_dir: Path, token_file: Path, tmp_path: Path, access: str
) -> Iterator[Path]:
    """A node and a root `allow_other` mount, both with `access`, serving the source as `ds`."""
    env = {**os.environ, "KSPEEDFS_ACCESS": access}
    node = NodeProcess(shm_dir, token_file, tmp_path, segment_size="4KiB", base_env=env).start()
    mount = MountProcess(public_dir / "mnt", node.env(), tmp_path, args=("-o", "allow_other"))
    try:
        node.request("preload", name="ds", source=str(_source(public_dir)))
        wait_for(lambda: node.request("progress", name="ds")["state"] == "ready")
        mount.start()
        yield public_dir / "mnt" / "ds"
    finally:
        mount.stop()
        node.stop()


def test_source_access_nobody_reads_what_the_source_lets_it(
    public_dir: Path, shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    with _mounted(public_dir, shm_dir, token_file, tmp_path, "source") as ds:
        nobody = as_user(NOBODY, [], lambda: _read_all(ds))
        in_group = as_user(NOBODY, [GROUP], lambda: _read_all(ds))
        as_root = _read_all(ds)
        shown = {name: os.stat(ds / name) for name in FILES}
        folder = os.stat(ds / "closed")
    assert nobody == {
        "public.bin": "ok",
        "private.bin": "EACCES",
        "group.bin": "EACCES",
        "closed/inside.bin": "EACCES",
    }
    assert in_group["group.bin"] == "ok" and in_group["private.bin"] == "EACCES"
    assert set(as_root.values()) == {"ok"}
    for name, (mode, gid) in FILES.items():
        st = shown[name]
        assert stat.S_IMODE(st.st_mode) == mode & ~0o222, name
        assert (st.st_uid, st.st_gid) == (0, gid), name
    assert stat.S_IMODE(folder.st_mode) == 0o500


def test_open_access_everyone_reads_everything(
    public_dir: Path, shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    with _mounted(public_dir, shm_dir, token_file, tmp_path, "open") as ds:
        nobody = as_user(NOBODY, [], lambda: _read_all(ds))
        modes = {name: stat.S_IMODE(os.stat(ds / name).st_mode) for name in FILES}
        folder = stat.S_IMODE(os.stat(ds / "closed").st_mode)
    assert set(nobody.values()) == {"ok"}
    assert set(modes.values()) == {0o444} and folder == 0o555


def _fast_path_reads(port: int, shm: Path, token: Path) -> dict[str, Any]:
    """In the child: the fast path's reads of each file (the local map from passed fds)."""
    addr = Address("127.0.0.1", port)
    settings = Settings(listen=addr, nodes=[addr], token_file=token, shm_dir=shm, timeout=10)
    reader = kspeedfs.client.reader.ClusterReader(settings, str(addr))
    ds = reader.open_dataset("ds")
    out: dict[str, Any] = {"local": type(ds.local).__name__}
    for name in FILES:
        i = ds.manifest.resolve(name)
        out[name + " passed"] = ds.local is not None and ds.local.holds_file(i)
        try:
            data = reader.read(ds, i, 0, 1 << 20)
            out[name] = "ok" if data == CONTENT[name] else "wrong bytes"
        except KSpeedError as e:
            out[name] = type(e).__name__
    return out


@pytest.mark.parametrize("access", ["source", "open"])
def test_passed_fds_hold_only_files_the_uid_may_read(
    access: str, public_dir: Path, shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "KSPEEDFS_ACCESS": access, "KSPEEDFS_GROUP": str(GROUP + 1)}
    node = NodeProcess(shm_dir, token_file, tmp_path, segment_size="4KiB", base_env=env).start()
    token = public_dir / "read.token"
    auth.write_token(token, auth.derive_token(auth.read_token(token_file), "read"))
    os.chown(token, NOBODY, NOBODY)
    try:
        node.request("preload", name="ds", source=str(_source(public_dir)))
        wait_for(lambda: node.request("progress", name="ds")["state"] == "ready")
        out = as_user(NOBODY, [], lambda: _fast_path_reads(node.port, shm_dir, token))
    finally:
        node.stop()
    assert out["local"] == "PassedDataset"
    assert out["public.bin passed"] and out["public.bin"] == "ok"
    if access == "open":
        assert all(out[name] == "ok" and out[name + " passed"] for name in FILES)
    else:
        # Not passed: one node, so the next copy is the source, where the uid is refused.
        for name in ("private.bin", "group.bin", "closed/inside.bin"):
            assert not out[name + " passed"] and out[name] == "DataError", name


def test_manifest_records_owners_and_reads_format_1(public_dir: Path, tmp_path: Path) -> None:
    tree = scan_tree(_source(public_dir))
    offsets, seg_len = plan_layout(tree, 4096)
    header = {"name": "t", "uuid": "u", "segment_size": 4096}
    args = (tree, offsets, [0] * len(tree), seg_len, [0] * len(seg_len), header)
    write_manifest(tmp_path / "m2.ksm", *args)
    m = Manifest(tmp_path / "m2.ksm")
    group = m.resolve("group.bin")
    assert (int(m.uid[group]), int(m.gid[group])) == (0, GROUP)
    readable = m.readable_files(NOBODY, [NOBODY])
    assert [name for name in FILES if readable[m.resolve(name)]] == ["public.bin"]
    assert readable.sum() == 1 and m.readable_files(0, [0]).sum() == len(FILES)
    assert m.readable_files(NOBODY, [GROUP])[group]
    # Format 1: the same file without the owner arrays (and with times as nanoseconds, as
    # formats 1-3 kept them); entries read as root's, with their modes.
    arrays = {
        key: np.frombuffer(m._map, dtype=dtype, count=count, offset=offset).copy()
        for key, (offset, dtype, count) in m.header["arrays"].items()
    }
    del arrays["uid"], arrays["gid"], arrays["ctime_s"], arrays["ctime_nsec"]
    del arrays["ident"], arrays["dev"]
    arrays["mtime_ns"] = (arrays.pop("mtime_s") * NS + arrays.pop("mtime_nsec")).astype("<i8")
    header = {k: v for k, v in m.header.items() if k not in ("arrays", "versions")}
    write_arrays(tmp_path / "m1.ksm", arrays, dict(header, format=1))
    m1 = Manifest(tmp_path / "m1.ksm")
    assert int(m1.gid[m1.resolve("group.bin")]) == 0 and int(m1.uid[0]) == 0
    assert m1.readable_files(NOBODY, [GROUP]).sum() == 1  # group.bin is root's group's now


def test_object_store_listing_is_owned_by_root_and_world_readable() -> None:
    tree = tree_from_listing({b"a/b.bin": (3, 0, 0), b"c.bin": (4, 0, 0)})
    assert set(tree.uid) == set(tree.gid) == {0}
    assert all(m & 0o004 for m in tree.mode)
