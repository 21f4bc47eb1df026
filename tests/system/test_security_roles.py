"""Roles: each op needs its documented role; bad fields are one-line refusals, counted."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, wait_for

from kspeedfs.format import auth, protocol
from kspeedfs.format.config import Settings
from kspeedfs.format.errors import AuthError, KSpeedError
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.node.server import NodeServer

pytestmark = pytest.mark.slow  # a node start per case

# The documented table (docs/security.md, "Roles"): the least role each op needs; adopt and
# rebalance need etcd (tests/unit/repo/test_docs.py checks the table with them).
NEEDS = {
    "ping": "read",
    "status": "read",
    "list": "read",
    "loop_report": "read",
    "jobs": "read",
    "progress": "read",
    "manifest": "read",
    "meta_index": "read",
    "decode_status": "read",
    "rdma_connect": "read",
    "rdma_segments": "read",
    "report_damage": "read",
    "lease_acquire": "job",
    "lease_renew": "job",
    "lease_release": "job",
    "preload": "job",
    "fill": "job",
    "touch": "job",
    "plan": "job",  # a job's readers tell the node their order
    "decode": "job",
    "meta_add": "job",
    "register_source": "admin",
    "refresh": "admin",
    "unload": "admin",
    "unload_local": "admin",
    "stage": "admin",
    "stage_claim": "admin",
    "stage_status": "admin",
    "stage_result": "admin",
    "stage_manifest": "admin",
    "stage_put": "admin",
    "stage_push": "admin",
    "stage_meta": "admin",
    "meta_reserve": "admin",
    "meta_put": "admin",
    "meta_commit": "admin",
    "meta_abort": "admin",
    "decode_local": "admin",
    "decode_drop": "admin",
    "stage_done": "admin",
    "commit": "admin",
    "abort": "admin",
    "shutdown": "admin",
}
ALLOWED = {
    "admin": set(NEEDS),
    "job": {op for op, r in NEEDS.items() if r in ("job", "read")},
    "read": {op for op, r in NEEDS.items() if r == "read"},
}


@pytest.fixture
def secured(shm_dir: Path, token_file: Path, tmp_path: Path) -> Any:
    roots = tmp_path / "roots"
    roots.mkdir()
    env = {**os.environ, "KSPEEDFS_SOURCE_ROOTS": str(roots)}
    node = NodeProcess(shm_dir, token_file, tmp_path, base_env=env).start()
    admin = auth.read_token(token_file)
    files = {"admin": token_file}
    for role in ("job", "read"):
        files[role] = tmp_path / f"{role}.token"
        auth.write_token(files[role], auth.derive_token(admin, role))
    yield node, files, roots
    node.stop()


def _client(node: NodeProcess, token_file: Path) -> NodeClient:
    return NodeClient(Address("127.0.0.1", node.port), token_file, timeout=10)


def test_the_registry_is_the_documented_table(tmp_path: Path) -> None:
    settings = Settings(shm_dir=tmp_path / "shm", token_file=tmp_path / "t", transport="tcp")
    server = NodeServer(settings)
    assert sorted(server.ops.names()) == sorted(NEEDS)
    for role, ops in ALLOWED.items():
        assert set(server.ops.allowed(role)) == ops, role


def test_every_op_with_each_role(secured: Any) -> None:
    node, files, _roots = secured
    for role in ("read", "job", "admin"):
        allowed = set()
        with _client(node, files[role]) as c:
            for op in sorted(NEEDS, key=lambda o: o == "shutdown"):
                if op == "shutdown" and role == "admin":
                    continue  # checked by its own node below
                try:
                    c.request(op)
                    allowed.add(op)
                except AuthError as e:
                    if "role" not in str(e) or "needs the" not in str(e):
                        allowed.add(op)  # refused by the op itself, not by its role
                except KSpeedError:
                    allowed.add(op)  # got past the role check, refused for its arguments
        expected = ALLOWED[role] - ({"shutdown"} if role == "admin" else set())
        assert allowed == expected, role
    with _client(node, files["admin"]) as c:
        assert c.request("shutdown")["state"] == "stopping"


def test_job_preloads_only_under_source_roots_with_a_lease(secured: Any, tmp_path: Path) -> None:
    node, files, roots = secured
    inside = roots / "data"
    inside.mkdir()
    (inside / "f.bin").write_bytes(b"x" * 1000)
    outside = tmp_path / "private"
    outside.mkdir(mode=0o700)
    (outside / "f.bin").write_bytes(b"secret")
    os.symlink(outside, roots / "link-out")
    with _client(node, files["job"]) as c:
        for source in (str(outside), str(roots / "link-out"), f"{roots}/../private"):
            with pytest.raises(AuthError, match="only under"):
                c.request("preload", name="bad", source=source)
        with pytest.raises(AuthError, match="lease"):
            c.request("preload", name="bad", source=str(inside), lifetime="offline")
        c.request("preload", name="data", source=str(inside))
        wait_for(lambda: c.request("progress", name="data")["state"] == "ready")
        (entry,) = [d for d in c.request("list")["datasets"] if d["name"] == "data"]
        assert entry["lifetime"] == "leased"
        with pytest.raises(AuthError, match="admin"):
            c.request("unload", name="data")
    with _client(node, files["read"]) as c, pytest.raises(AuthError, match="job"):
        c.request("lease_acquire", name="data")
    assert "bad" not in {d["name"] for d in node.request("list")["datasets"]}


def test_bad_fields_are_refused_counted_and_the_node_serves_on(
    secured: Any, tmp_path: Path
) -> None:
    node, files, roots = secured
    src = roots / "d"
    src.mkdir()
    (src / "f").write_bytes(b"abc")
    node.request("preload", name="d", source=str(src))
    wait_for(lambda: node.request("progress", name="d")["state"] == "ready")
    refused = node.request("status")["stats"]["refused"]
    bad: list[dict[str, Any]] = [
        {"op": "manifest", "name": "d", "offset": -1},
        {"op": "manifest", "name": "d", "length": -5},
        {"op": "manifest", "name": "d", "offset": "12"},
        {"op": "manifest", "name": "d", "offset": 1.5},
        {"op": "manifest", "name": 7},
        {"op": "lease_renew", "lease": ["x"]},
        {"op": "lease_acquire", "name": "d", "holder": {"a": 1}},
        {"op": ["list"]},
    ]
    with _client(node, files["admin"]) as c:
        for args in bad:
            op = args.pop("op")
            with pytest.raises(KSpeedError) as info:
                c.request(op, **args)
            assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
        assert c.request("ping")["node"] == node.address  # same connection, still served
    # Handshakes with a non-ASCII mac, a wrong type, a non-object: refused, counted.
    for auth_msg in (
        {"role": "admin", "mac": "é" * 64},
        {"role": "admin", "mac": 12},
        {"role": ["admin"], "mac": "00"},
        [1, 2],
    ):
        kind = _raw_handshake(node.port, auth_msg)
        assert kind == "AuthError"
    stats = node.request("status")["stats"]
    assert stats["refused"] >= refused + len(bad) + 4
    assert "Traceback" not in node.log_path.read_text()


def _raw_handshake(port: int, auth_msg: object) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        decoder = protocol.FrameDecoder()
        hello = _frame(s, decoder)
        assert hello.type == MsgType.HELLO
        payload = json.dumps(auth_msg).encode()
        s.sendall(protocol.encode_header(MsgType.AUTH, 0, len(payload)) + payload)
        answer = _frame(s, decoder)
        assert answer.type == MsgType.ERROR
        return str(answer.json()["kind"])


def _frame(s: socket.socket, decoder: protocol.FrameDecoder) -> protocol.Frame:
    while (frame := decoder.next_frame()) is None:
        data = s.recv(65536)
        assert data, "connection closed"
        decoder.feed(data)
    return frame
